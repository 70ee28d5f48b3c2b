// A fake libnvjpeg and libcuda in one library, for gpudecode's tests on a
// machine without a GPU: the types are nvjpeg.h's and cuda.h's, so the
// compiler lays them out as the real libraries expect, and the functions
// check what they receive. "Device" memory is host memory here. A fake
// JPEG is 4 bytes of width and height (uint16 little-endian) and a seed
// byte; DecodeBatched writes pixel (x, y) of plane c as
// (seed + 50*c + 3*y + x) mod 256; DecodeBatchedEx writes the region each
// image's nvjpegDecodeParams_t names, at the destination's origin.
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
enum { NO_HW, HW_UNSUPPORTED, LAST_BACKEND, BATCH, FORMAT, CUR_CTX, LAST_STREAM, COPIES, DECODES,
       NO_ROI, ROI_FAIL, ROI_DECODES, PARAMS_LIVE, N_KNOBS };
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

// nvjpegDecodeParams_t: the fields the ROI decode reads.
struct params { int fmt, x, y, w, h; struct handle *h0; };

int nvjpegDecodeParamsCreate(struct handle *h, struct params **p) {
	if (!h) return 2;
	*p = calloc(1, sizeof **p);
	(*p)->h0 = h;
	knobs[PARAMS_LIVE]++;
	return 0;
}
int nvjpegDecodeParamsDestroy(struct params *p) { free(p); knobs[PARAMS_LIVE]--; return 0; }
int nvjpegDecodeParamsSetOutputFormat(struct params *p, int fmt) { p->fmt = fmt; return 0; }
int nvjpegDecodeParamsSetROI(struct params *p, int x, int y, int w, int h) {
	if (x < 0 || y < 0) return 2;
	p->x = x, p->y = y, p->w = w, p->h = h;
	return 0;
}
int nvjpegDecodeBatchedSupportedEx(struct handle *h, void *js, struct params *p, int *not_supported) {
	if (!p || p->h0 != h) return 2;
	*not_supported = knobs[NO_ROI] || h->backend != 3 ? 1 : 0; // hardware only, as the real one
	return 0;
}
int nvjpegDecodeBatchedEx(struct handle *h, void *st, const unsigned char *const *data, const size_t *lengths,
			  nvjpegImage_t *dst, struct params **params, void *stream) {
	if (!h || !st || knobs[FORMAT] != 3) return 2;
	if (knobs[CUR_CTX] == 0) return 1;
	if (knobs[ROI_FAIL]) return 9; // NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED
	knobs[LAST_STREAM] = (long long)(uintptr_t)stream;
	for (int i = 0; i < knobs[BATCH]; i++) {
		struct params *p = params[i];
		if (lengths[i] < 5 || !p || p->h0 != h || p->fmt != 3 || p->w < 1 || p->h < 1) return 2;
		int w, ht;
		dims(data[i], &w, &ht);
		if (p->x + p->w > w || p->y + p->h > ht) return 3;
		for (int c = 0; c < 3; c++) {
			if (dst[i].pitch[c] < (size_t)p->w || !dst[i].channel[c]) return 2;
			for (int y = 0; y < p->h; y++)
				for (int x = 0; x < p->w; x++)
					dst[i].channel[c][y * dst[i].pitch[c] + x] =
						(unsigned char)(data[i][4] + 50 * c + 3 * (y + p->y) + (x + p->x));
		}
		if (dst[i].channel[3] || dst[i].pitch[3]) return 2;
	}
	knobs[ROI_DECODES]++;
	return 0;
}
