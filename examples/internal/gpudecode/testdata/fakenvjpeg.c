// A fake libnvjpeg and libcuda in one library, for gpudecode's tests on a
// machine without a GPU: the types are nvjpeg.h's and cuda.h's, so the
// compiler lays them out as the real libraries expect, and the functions
// check what they receive. "Device" memory is host memory here. A fake
// JPEG is 4 bytes of width and height (uint16 little-endian) and a seed
// byte; DecodeBatched writes pixel (x, y) of plane c as
// (seed + 50*c + 3*y + x) mod 256.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
	unsigned char *channel[4];
	size_t pitch[4];
} nvjpegImage_t;

typedef enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 } CUmemorytype;

typedef struct CUDA_MEMCPY2D_st {
	size_t srcXInBytes;
	size_t srcY;
	CUmemorytype srcMemoryType;
	const void *srcHost;
	unsigned long long srcDevice;
	void *srcArray;
	size_t srcPitch;
	size_t dstXInBytes;
	size_t dstY;
	CUmemorytype dstMemoryType;
	void *dstHost;
	unsigned long long dstDevice;
	void *dstArray;
	size_t dstPitch;
	size_t WidthInBytes;
	size_t Height;
} CUDA_MEMCPY2D;

_Static_assert(sizeof(nvjpegImage_t) == 64, "nvjpegImage_t");
_Static_assert(sizeof(CUDA_MEMCPY2D) == 128, "CUDA_MEMCPY2D");

// What the test sets (fake_set) and reads (fake_get).
enum { NO_HW, HW_UNSUPPORTED, LAST_BACKEND, BATCH, FORMAT, CUR_CTX, LAST_STREAM, COPIES, DECODES, N_KNOBS };
static long long knobs[N_KNOBS];
void fake_set(int k, long long v) { knobs[k] = v; }
long long fake_get(int k) { return knobs[k]; }

struct handle { int backend; };

int nvjpegGetProperty(int type, int *v) { *v = type == 0 ? 12 : type == 1 ? 3 : 4; return 0; }

int nvjpegCreateEx(int backend, void *dev_alloc, void *pinned_alloc, unsigned flags, struct handle **h) {
	if (dev_alloc || pinned_alloc || flags) return 2;
	if (backend == 3 && knobs[NO_HW]) return 7; // NVJPEG_STATUS_ARCH_MISMATCH
	*h = malloc(sizeof **h);
	(*h)->backend = backend;
	knobs[LAST_BACKEND] = backend;
	return 0;
}
int nvjpegDestroy(struct handle *h) { free(h); return 0; }
int nvjpegJpegStateCreate(struct handle *h, void **st) { *st = malloc(8); return h ? 0 : 2; }
int nvjpegJpegStateDestroy(void *st) { free(st); return 0; }

static void dims(const unsigned char *d, int *w, int *h) {
	*w = d[0] | d[1] << 8;
	*h = d[2] | d[3] << 8;
}

int nvjpegGetImageInfo(struct handle *h, const unsigned char *data, size_t len, int *nc, int *css, int *ws, int *hs) {
	if (len < 5) return 3;
	int w, ht;
	dims(data, &w, &ht);
	*nc = 3;
	*css = 2;
	ws[0] = w, hs[0] = ht, ws[1] = ws[2] = (w + 1) / 2, hs[1] = hs[2] = (ht + 1) / 2, ws[3] = hs[3] = 0;
	return 0;
}

int nvjpegDecodeBatchedInitialize(struct handle *h, void *st, int batch, int threads, int fmt) {
	if (!h || !st || batch < 1 || threads < 1) return 2;
	knobs[BATCH] = batch;
	knobs[FORMAT] = fmt;
	return 0;
}

int nvjpegDecodeBatched(struct handle *h, void *st, const unsigned char *const *data, const size_t *lengths,
			nvjpegImage_t *dst, void *stream) {
	if (!h || !st || knobs[FORMAT] != 3) return 2;
	if (knobs[CUR_CTX] == 0) return 1; // no current context
	knobs[LAST_STREAM] = (long long)(uintptr_t)stream;
	for (int i = 0; i < knobs[BATCH]; i++) {
		if (lengths[i] < 5) return 3;
		int w, ht;
		dims(data[i], &w, &ht);
		for (int c = 0; c < 3; c++) {
			if (dst[i].pitch[c] < (size_t)w || !dst[i].channel[c]) return 2;
			for (int y = 0; y < ht; y++)
				for (int x = 0; x < w; x++)
					dst[i].channel[c][y * dst[i].pitch[c] + x] = (unsigned char)(data[i][4] + 50 * c + 3 * y + x);
		}
		if (dst[i].channel[3] || dst[i].pitch[3]) return 2;
	}
	knobs[DECODES]++;
	return 0;
}

int nvjpegJpegStreamCreate(struct handle *h, void **js) { *js = malloc(8); return 0; }
int nvjpegJpegStreamDestroy(void *js) { free(js); return 0; }
int nvjpegJpegStreamParse(struct handle *h, const unsigned char *d, size_t len, int meta, int save, void *js) {
	return len < 5 ? 3 : 0;
}
int nvjpegDecodeBatchedSupported(struct handle *h, void *js, int *not_supported) {
	*not_supported = knobs[HW_UNSUPPORTED] ? 1 : 0;
	return 0;
}

int cuCtxSetCurrent(void *ctx) { knobs[CUR_CTX] = (long long)(uintptr_t)ctx; return 0; }
int cuStreamSynchronize(void *s) { return 0; }
int cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, void *stream) {
	if (p->srcMemoryType != CU_MEMORYTYPE_DEVICE || p->dstMemoryType != CU_MEMORYTYPE_DEVICE) return 1;
	if (p->srcPitch < p->WidthInBytes || p->dstPitch < p->WidthInBytes || p->srcArray || p->dstArray) return 1;
	if ((long long)(uintptr_t)stream != knobs[LAST_STREAM]) return 400; // not the decode's stream
	for (size_t r = 0; r < p->Height; r++)
		memcpy((char *)(uintptr_t)p->dstDevice + (p->dstY + r) * p->dstPitch + p->dstXInBytes,
		       (const char *)(uintptr_t)p->srcDevice + (p->srcY + r) * p->srcPitch + p->srcXInBytes, p->WidthInBytes);
	knobs[COPIES]++;
	return 0;
}
