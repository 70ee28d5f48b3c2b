/*
 * A fake libcuda for the tests of package cuda: every function the binding
 * needs, with the signature cuda.h (CUDA 13.0) gives it, recording its own
 * name (__func__) and its arguments as C received them, and returning a
 * result code the test sets. fake_last reads the record back.
 *
 * Built by the tests with gcc -shared -fPIC -Wl,-Bsymbolic; a linker version
 * script hides chosen symbols to make a library that lacks them.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef struct CUipcMemHandle_st { char reserved[64]; } CUipcMemHandle;
typedef struct CUipcEventHandle_st { char reserved[64]; } CUipcEventHandle;
typedef struct CUctxCreateParams_st {
	void *execAffinityParams;
	int numExecAffinityParams;
	void *cigParams;
} CUctxCreateParams;

typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUmemLocation_st { int type; int id; } CUmemLocation;
typedef struct CUmemAllocationProp_st {
	int type;
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct CUmemAccessDesc_st { CUmemLocation location; int flags; } CUmemAccessDesc;
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

#define MAXARGS 8

static char last_name[64];
static uint64_t last_args[MAXARGS];
static int last_nargs;
static unsigned char last_handle[64];
static CUresult result_code;

static CUresult rec(const char *name, int n, const uint64_t *args) {
	memset(last_name, 0, sizeof last_name);
	strncpy(last_name, name, sizeof last_name - 1);
	memset(last_args, 0, sizeof last_args);
	memcpy(last_args, args, (size_t)n * sizeof *args);
	last_nargs = n;
	return result_code;
}

/* Each argument is recorded as C sees it, widened the C way: a pointer or
 * an unsigned type zero-extended, an int sign-extended. */
#define P(x) ((uint64_t)(uintptr_t)(x))
#define I(x) ((uint64_t)(int64_t)(x))
#define U(x) ((uint64_t)(x))
#define REC(...)                                                     \
	do {                                                             \
		uint64_t a_[] = {__VA_ARGS__};                               \
		return rec(__func__, (int)(sizeof a_ / sizeof a_[0]), a_);  \
	} while (0)
#define REC0() return rec(__func__, 0, NULL)

/* Test controls. */
void fake_set_result(CUresult r) { result_code = r; }
int fake_last(char *name, uint64_t *args, unsigned char *handle) {
	memcpy(name, last_name, sizeof last_name);
	memcpy(args, last_args, sizeof last_args);
	memcpy(handle, last_handle, sizeof last_handle);
	return last_nargs;
}
/* A call with no work, to measure the cost of a call. */
CUresult fake_nop(void *p, size_t n) { (void)p; (void)n; return 0; }

CUresult cuInit(unsigned int flags) { REC(U(flags)); }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 13000; REC(P(v)); }
CUresult cuDeviceGetCount(int *n) { if (n) *n = 3; REC(P(n)); }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { REC(P(d), I(ordinal)); }
CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
	if (name && len > 0) snprintf(name, (size_t)len, "Fake GPU %d", dev);
	REC(P(name), I(len), I(dev));
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice dev) { REC(P(u), I(dev)); }
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice dev) { REC(P(u), I(dev)); }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice dev) { REC(P(b), I(dev)); }
CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice dev) { REC(P(v), I(attrib), I(dev)); }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice dev) { REC(P(c), I(dev)); }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { REC(I(dev)); }
CUresult cuCtxCreate_v2(CUcontext *c, unsigned int flags, CUdevice dev) { REC(P(c), U(flags), I(dev)); }
CUresult cuCtxCreate_v4(CUcontext *c, CUctxCreateParams *p, unsigned int flags, CUdevice dev) {
	/* The last word says whether p points to an all-zero struct. */
	int zero = p && !p->execAffinityParams && !p->numExecAffinityParams && !p->cigParams;
	REC(P(c), P(p), U(flags), I(dev), U(zero));
}
CUresult cuCtxDestroy_v2(CUcontext c) { REC(P(c)); }
CUresult cuCtxSetCurrent(CUcontext c) { REC(P(c)); }
CUresult cuCtxGetCurrent(CUcontext *c) { REC(P(c)); }
CUresult cuCtxGetDevice(CUdevice *d) { REC(P(d)); }
CUresult cuCtxSynchronize(void) { REC0(); }
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) { REC(P(peer), U(flags)); }
CUresult cuCtxDisablePeerAccess(CUcontext peer) { REC(P(peer)); }
CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer) { REC(P(can), I(dev), I(peer)); }
CUresult cuDeviceGetP2PAttribute(int *v, int attrib, CUdevice src, CUdevice dst) { REC(P(v), I(attrib), I(src), I(dst)); }
CUresult cuDeviceGetP2PAtomicCapabilities(unsigned int *caps, const int *ops, unsigned int count, CUdevice src, CUdevice dst) {
	REC(P(caps), P(ops), U(count), I(src), I(dst));
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { REC(P(p), U(n)); }
CUresult cuMemFree_v2(CUdeviceptr p) { REC(U(p)); }
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) { REC(P(free), P(total)); }
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) { REC(P(base), P(size), U(p)); }
CUresult cuPointerGetAttribute(void *data, int attrib, CUdeviceptr p) { REC(P(data), I(attrib), U(p)); }
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n) { REC(U(dst), U(uc), U(n)); }
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) { REC(U(dst), U(uc), U(n), P(s)); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { REC(U(dst), P(src), U(n)); }
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { REC(P(dst), U(src), U(n)); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { REC(U(dst), U(src), U(n)); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { REC(U(dst), U(src), U(n), P(s)); }
CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n) {
	REC(U(dst), P(dctx), U(src), P(sctx), U(n));
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { REC(U(dst), P(src), U(n), P(s)); }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) { REC(P(dst), U(src), U(n), P(s)); }
CUresult cuMemHostAlloc(void **pp, size_t n, unsigned int flags) {
	if (pp) *pp = (void *)(uintptr_t)0x7e00beef0000ull;
	REC(P(pp), U(n), U(flags));
}
CUresult cuMemFreeHost(void *p) { REC(P(p)); }
CUresult cuStreamCreate(CUstream *s, unsigned int flags) { REC(P(s), U(flags)); }
CUresult cuStreamDestroy_v2(CUstream s) { REC(P(s)); }
CUresult cuStreamSynchronize(CUstream s) { REC(P(s)); }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) { REC(P(s), P(e), U(flags)); }
CUresult cuStreamGetCtx(CUstream s, CUcontext *c) {
	if (c) *c = (CUcontext)(uintptr_t)0x7f00c0ffee00ull;
	REC(P(s), P(c));
}
CUresult cuEventCreate(CUevent *e, unsigned int flags) { REC(P(e), U(flags)); }
CUresult cuEventDestroy_v2(CUevent e) { REC(P(e)); }
CUresult cuEventRecord(CUevent e, CUstream s) { REC(P(e), P(s)); }
CUresult cuEventSynchronize(CUevent e) { REC(P(e)); }
CUresult cuEventQuery(CUevent e) { REC(P(e)); }
CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b) { if (ms) *ms = 1.5f; REC(P(ms), P(a), P(b)); }
CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { if (ms) *ms = 2.5f; REC(P(ms), P(a), P(b)); }
CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e) { REC(P(h), P(e)); }
CUresult cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h) {
	memcpy(last_handle, h.reserved, sizeof last_handle);
	REC(P(e));
}
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) { REC(P(h), U(p)); }
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
	memcpy(last_handle, h.reserved, sizeof last_handle);
	REC(P(p), U(flags));
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) { REC(U(p)); }
/* VMM. Each records its arguments; the ones with out-parameters write a
 * value the test can recognise, and cuMemCreate/cuMemSetAccess record the
 * struct fields they read, to check the Go layout against gcc's. */
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
	if (g) *g = 2u << 20;
	REC(P(g), P(p), I(option), p ? I(p->type) : 0, p ? I(p->requestedHandleTypes) : 0, p ? I(p->location.type) : 0, p ? I(p->location.id) : 0);
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long flags) {
	if (h) *h = 0xabcdef0123ull;
	REC(P(h), U(size), P(p), U(flags), p ? I(p->requestedHandleTypes) : 0, p ? I(p->location.id) : 0, p ? U(p->allocFlags.gpuDirectRDMACapable) : 0);
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { REC(U(h)); }
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
	if (out) *(int *)out = 42;
	REC(P(out), U(h), I(type), U(flags));
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) {
	if (h) *h = 0x1234ull;
	REC(P(h), P(os), I(type));
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
	REC(P(p), U(size), U(align), U(addr), U(flags));
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { REC(U(p), U(size)); }
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long flags) {
	REC(U(p), U(size), U(off), U(h), U(flags));
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) { REC(U(p), U(size)); }
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *d, size_t count) {
	REC(U(p), U(size), P(d), U(count), d ? I(d[count - 1].location.type) : 0, d ? I(d[count - 1].location.id) : 0, d ? I(d[count - 1].flags) : 0);
}
CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr p) {
	if (flags) *flags = 3;
	REC(P(flags), P(loc), U(p));
}
CUresult cuGetErrorName(CUresult r, const char **s) {
	static char buf[64];
	snprintf(buf, sizeof buf, "FAKE_ERROR_%d", r);
	if (s) *s = buf;
	REC(I(r), P(s));
}

/* The unversioned compatibility symbols, 32-bit sizes where the real ones
 * have them: exported so that binding one by mistake shows up by name. */
CUresult cuMemAlloc(unsigned int *p, unsigned int n) { REC(P(p), U(n)); }
CUresult cuMemFree(unsigned int p) { REC(U(p)); }
CUresult cuMemGetInfo(unsigned int *free, unsigned int *total) { REC(P(free), P(total)); }
CUresult cuDeviceTotalMem(unsigned int *b, CUdevice dev) { REC(P(b), I(dev)); }
CUresult cuMemcpyHtoD(unsigned int dst, const void *src, unsigned int n) { REC(U(dst), P(src), U(n)); }
CUresult cuMemcpyHtoDAsync(unsigned int dst, const void *src, unsigned int n, CUstream s) { REC(U(dst), P(src), U(n), P(s)); }
CUresult cuCtxCreate(CUcontext *c, unsigned int flags, CUdevice dev) { REC(P(c), U(flags), I(dev)); }
CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
	memcpy(last_handle, h.reserved, sizeof last_handle);
	REC(P(p), U(flags));
}
CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { REC(I(dev)); }
