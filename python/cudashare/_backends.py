"""Where a lease's memory comes from: the real CUDA driver through ctypes,
or the simulator's memfds.

A backend imports one allocation per alloc_id (``open``), closes it
(``close``), and handles the producer's events and this consumer's
release events. The consumer picks one at connect time: the real driver
when libcuda.so.1 loads and the producer's device is one of its devices,
the simulator otherwise (the Go side runs its simulated driver on machines
without a GPU, and the simulator's devices have random UUIDs no real GPU
has). ``CUDASHARE_DRIVER=sim|cuda`` or ``connect(backend=...)`` forces it.
"""

import ctypes
import fcntl
import mmap
import os
import struct
import threading

from . import _wire as wire
from ._errors import DriverError, NotSupported

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapping:
    """One imported allocation. ``ptr`` is the address of its byte 0: a
    device pointer (cuda), a host address (sim, vmm), or None where
    the data is not reachable (sim, ipc)."""
    __slots__ = ("alloc_id", "kind", "ptr", "size", "handle", "extra", "closed")

    def __init__(self, alloc_id, kind, ptr, size, handle, extra=None):
        self.alloc_id, self.kind, self.ptr, self.size = alloc_id, kind, ptr, size
        self.handle, self.extra, self.closed = handle, extra, False


# --- the simulator ---------------------------------------------------------

SIM_HEADER = 4096
SIM_MAGIC = b"CSIMVMM1"
# The seals an allocation's memfd must have (PROTOCOL.md §4.1.1): without
# them its sender could shrink it under the mapping, and every later read
# of the lost pages would kill this process with SIGBUS.
SIM_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# ... and must not have: they make a writable shared mapping fail.
SIM_BAD_SEALS = fcntl.F_SEAL_WRITE | 0x0010  # F_SEAL_FUTURE_WRITE


def _check_sim_memfd(fd, alloc_size):
    """Checks that fd is an allocation's memfd that is safe to map
    (PROTOCOL.md §4.1.1) and returns the size of its memory; raises
    DriverError (CUDA_ERROR_UNKNOWN, as the simulator answers) naming what
    is wrong. The seals come first: once the memfd is sealed against
    shrinking, the size read after cannot change before the mapping."""
    def refuse(why, *args):
        raise DriverError("cuMemImportFromShareableHandle (sim)", 999,
                          "the descriptor is not a simulator VMM allocation: " + (why % args))
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        refuse("not a memfd (F_GET_SEALS: %s)", e)
    if seals & SIM_SEALS != SIM_SEALS:
        refuse("the memfd is not sealed against shrinking and growing (seals %#x): "
               "its sender could resize it under the mapping", seals)
    if seals & SIM_BAD_SEALS:
        refuse("the memfd is sealed against writing (seals %#x)", seals)
    try:
        hdr = os.pread(fd, 64, 0)
        st = os.fstat(fd)
    except OSError as e:
        refuse("%s", e)
    if len(hdr) < 24 or hdr[:8] != SIM_MAGIC:
        refuse("no %r header", SIM_MAGIC)
    version, _dev, size = struct.unpack_from("<IIQ", hdr, 8)
    if version != 1 or size < alloc_size:
        refuse("header version %d, %d bytes for an allocation of %d", version, size, alloc_size)
    if st.st_size != SIM_HEADER + size:
        refuse("the memfd has %d bytes, its header says %d of memory after %d", st.st_size, size, SIM_HEADER)
    return size


class SimBackend:
    """The simulator's representation (PROTOCOL.md §4.1.1): a vmm
    allocation is a sealed memfd with a 4096-byte header and then the
    memory, which any process maps MAP_SHARED. Legacy IPC
    handles name state only the Go simulator reads: such leases work as far
    as the protocol goes, and their data raises NotSupported."""

    name = "sim"
    on_host = True

    def __init__(self, device=0, reason="selected sim"):
        self.device = device
        self.dl_device = (1, 0)  # kDLCPU: the mapping is host memory
        self.reason = reason
        self.device_uuid = None

    def open(self, offer, fds):
        if offer.handle_kind == wire.HANDLE_IPC:
            return Mapping(offer.alloc_id, offer.handle_kind, None, offer.alloc_size, offer.handle)
        fd = fds[0]
        try:
            size = _check_sim_memfd(fd, offer.alloc_size)
            p = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, SIM_HEADER)
            if p is None or p == _MAP_FAILED:
                e = ctypes.get_errno()
                raise DriverError("mmap (sim)", e, os.strerror(e))
        finally:
            os.close(fd)  # the mapping holds the memory
        return Mapping(offer.alloc_id, offer.handle_kind, p, size, offer.handle)

    def close(self, m):
        if m.closed:
            return
        m.closed = True
        if m.ptr is not None:
            _libc.munmap(m.ptr, m.size)

    # Events: the simulator's are the Go process's; there is nothing to wait on
    # from here, and its memory is coherent.
    def open_event(self, handle):
        return None

    def wait_event(self, ev, stream):
        pass

    def destroy_event(self, ev):
        pass

    def new_release_event(self):
        raise NotSupported("a stream-ordered release needs the CUDA driver; the sim backend releases after the host is done")

    def sync_event(self, ev):
        pass

    def stream_sync(self, stream):
        pass

    def copy_to_host(self, ptr, n):
        return ctypes.string_at(ptr, n)

    def shutdown(self):
        pass


# --- the real driver -------------------------------------------------------

class _Handle64(ctypes.Structure):
    """CUipcMemHandle / CUipcEventHandle: 64 opaque bytes passed by value.

    Eight 64-bit words, not ``c_char * 64``: ctypes passes a struct holding an
    array by value wrongly on x86-64 with some Python versions (CPython issue
    22273; measured on an H100: the driver saw a zero handle, INVALID_VALUE
    for memory and MAP_FAILED for events), and reading a ``c_char`` array
    back stops at the first zero byte."""

    _fields_ = [("w%d" % i, ctypes.c_uint64) for i in range(8)]

    @classmethod
    def of(cls, b):
        return cls.from_buffer_copy(bytes(b).ljust(64, b"\0")[:64])

    def raw(self):
        return ctypes.string_at(ctypes.addressof(self), 64)


class _UUID(ctypes.Structure):
    """CUuuid. Read back with raw(): a ``c_char`` array's value stops at the
    first zero byte (an H100 whose UUID starts 7f00... was taken for a
    simulated device that way)."""

    _fields_ = [("bytes", ctypes.c_char * 16)]

    def raw(self):
        return ctypes.string_at(ctypes.addressof(self), 16)


class _AccessDesc(ctypes.Structure):
    # CUmemAccessDesc: CUmemLocation {int type; int id}, then the flags.
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]


CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4

_P = ctypes.c_void_p
_U64 = ctypes.c_uint64
_SIGS = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGetUuid": [ctypes.POINTER(_UUID), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxSetCurrent": [_P],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_U64), _Handle64, ctypes.c_uint],
    "cuIpcCloseMemHandle": [_U64],
    "cuIpcOpenEventHandle": [ctypes.POINTER(_P), _Handle64],
    "cuIpcGetEventHandle": [ctypes.POINTER(_Handle64), _P],
    "cuEventCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuEventRecord": [_P, _P],
    "cuEventSynchronize": [_P],
    "cuEventDestroy_v2": [_P],
    "cuStreamWaitEvent": [_P, _P, ctypes.c_uint],
    "cuStreamSynchronize": [_P],
    "cuMemcpyDtoH_v2": [_P, _U64, ctypes.c_size_t],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_U64), _P, ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(_U64), ctypes.c_size_t, ctypes.c_size_t, _U64, ctypes.c_ulonglong],
    "cuMemMap": [_U64, ctypes.c_size_t, ctypes.c_size_t, _U64, ctypes.c_ulonglong],
    "cuMemSetAccess": [_U64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t],
    "cuMemUnmap": [_U64, ctypes.c_size_t],
    "cuMemAddressFree": [_U64, ctypes.c_size_t],
    "cuMemRelease": [_U64],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


# Calls that need no current context (device queries, context management).
_NO_CTX = frozenset(("cuInit", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetUuid", "cuDevicePrimaryCtxRetain",
                     "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent", "cuGetErrorString"))


class _Current(threading.local):
    """Per thread: whether this backend's context was made current there."""
    ok = False


class CudaBackend:
    """The CUDA driver API through ctypes on libcuda.so.1. Every call runs
    with the device's primary context current in the calling thread.

    Each driver function is bound once, as an attribute named after it
    (``self.cuEventRecord``): no lookup by name per call. The context is
    made current once per thread (a thread-local flag); a call that fails
    in a thread whose flag was set makes the context current again and is
    retried once (another library may have switched that thread's context),
    so errors stay those of the call itself: DriverError(function, code).
    The per-lease calls (wait_event, record) create no ctypes objects.

    lib: a stand-in for the loaded libcuda.so.1 (tests); its functions get
    the argtypes of _SIGS like the real ones."""

    name = "cuda"
    on_host = False

    def __init__(self, device=0, reason="selected cuda", lib=None):
        self.reason = reason
        if lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise NotSupported("cannot load libcuda.so.1: %s" % e)
        self.fn = {}
        for name, args in _SIGS.items():
            try:
                f = getattr(lib, name)
            except AttributeError:
                raise NotSupported("libcuda.so.1 lacks %s (driver too old)" % name)
            f.argtypes, f.restype = args, ctypes.c_int
            self.fn[name] = f
            setattr(self, name, f)
        self._cur = _Current()
        self.ctx = None
        self.released = False
        self.call("cuInit", 0)
        self.device = device
        self.dl_device = (2, device)  # kDLCUDA, this process's ordinal
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), device)
        self.dev = dev.value
        u = _UUID()
        self.call("cuDeviceGetUuid", ctypes.byref(u), self.dev)
        self.device_uuid = u.raw()
        ctx = _P()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.dev)
        self.ctx = ctx.value

    def _make_current(self):
        r = self.cuCtxSetCurrent(self.ctx)
        if r:
            self._cur.ok = False
            raise DriverError("cuCtxSetCurrent", r, self.errstr(r))
        self._cur.ok = True

    def _failed(self, name, f, args, r):
        """A call returned r: retried once with the context made current
        again when this thread had it set before; raises DriverError."""
        if name not in _NO_CTX and self._cur.ok:
            self._make_current()
            r = f(*args)
            if not r:
                return
        raise DriverError(name, r, self.errstr(r))

    def call(self, name, *args):
        """Calls the driver function name (the context current first where
        it needs one); raises DriverError(name, code) on failure."""
        f = self.fn[name]
        if not self._cur.ok and name not in _NO_CTX:
            self._make_current()
        r = f(*args)
        if r:
            self._failed(name, f, args, r)

    def errstr(self, r):
        s = ctypes.c_char_p()
        if self.cuGetErrorString(r, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode(errors="replace")
        return ""

    def device_uuids(self):
        n = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(n))
        out = []
        for i in range(n.value):
            d, u = ctypes.c_int(), _UUID()
            self.call("cuDeviceGet", ctypes.byref(d), i)
            self.call("cuDeviceGetUuid", ctypes.byref(u), d.value)
            out.append(u.raw())
        return out

    def open(self, offer, fds):
        if offer.handle_kind == wire.HANDLE_IPC:
            p = _U64()
            self.call("cuIpcOpenMemHandle_v2", ctypes.byref(p), _Handle64.of(offer.handle),
                      CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            return Mapping(offer.alloc_id, offer.handle_kind, p.value, offer.alloc_size, offer.handle)
        fd = fds[0]
        h = _U64()
        try:
            self.call("cuMemImportFromShareableHandle", ctypes.byref(h), fd,
                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        finally:
            os.close(fd)  # the import holds the memory
        size = offer.alloc_size
        p = _U64()
        try:
            self.call("cuMemAddressReserve", ctypes.byref(p), size, 0, 0, 0)
            try:
                self.call("cuMemMap", p.value, size, 0, h.value, 0)
                try:
                    desc = _AccessDesc(CU_MEM_LOCATION_TYPE_DEVICE, self.dev, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                    self.call("cuMemSetAccess", p.value, size, ctypes.byref(desc), 1)
                except BaseException:
                    self.cuMemUnmap(p.value, size)
                    raise
            except BaseException:
                self.cuMemAddressFree(p.value, size)
                raise
        except BaseException:
            self.cuMemRelease(h.value)
            raise
        return Mapping(offer.alloc_id, offer.handle_kind, p.value, size, offer.handle, extra=h.value)

    def close(self, m):
        if m.closed:
            return
        m.closed = True
        if m.kind == wire.HANDLE_IPC:
            self.call("cuIpcCloseMemHandle", m.ptr)
        else:
            self.call("cuMemUnmap", m.ptr, m.size)
            self.call("cuMemAddressFree", m.ptr, m.size)
            self.call("cuMemRelease", m.extra)

    def open_event(self, handle):
        """Opens a producer's event, once per handle (the consumer caches it)."""
        ev = _P()
        self.call("cuIpcOpenEventHandle", ctypes.byref(ev), _Handle64.of(handle))
        return ev.value

    # The per-lease calls: one driver call each, no ctypes object made.

    def wait_event(self, ev, stream):
        """Orders stream after ev (no host wait)."""
        if not self._cur.ok:
            self._make_current()
        f = self.cuStreamWaitEvent
        r = f(stream, ev, 0)
        if r:
            self._failed("cuStreamWaitEvent", f, (stream, ev, 0), r)

    def record(self, ev, stream):
        """Records ev (a release event) on stream."""
        if not self._cur.ok:
            self._make_current()
        f = self.cuEventRecord
        r = f(ev, stream)
        if r:
            self._failed("cuEventRecord", f, (ev, stream), r)

    def sync_event(self, ev):
        self.call("cuEventSynchronize", ev)

    def destroy_event(self, ev):
        self.call("cuEventDestroy_v2", ev)

    def new_release_event(self):
        """An interprocess event and its IPC handle, computed here once:
        the consumer keeps one per stream and records it at each release."""
        ev = _P()
        self.call("cuEventCreate", ctypes.byref(ev), CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)
        h = _Handle64()
        try:
            self.call("cuIpcGetEventHandle", ctypes.byref(h), ev.value)
        except BaseException:
            self.cuEventDestroy_v2(ev.value)
            raise
        return ev.value, h.raw()

    def stream_sync(self, stream):
        self.call("cuStreamSynchronize", stream)

    def copy_to_host(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        if n:
            self.call("cuMemcpyDtoH_v2", buf, ptr, n)
        return buf.raw

    def shutdown(self):
        if not self.released:
            self.released = True
            if self.ctx is not None:
                self.cuDevicePrimaryCtxRelease_v2(self.dev)


def select(kind, device, producer_devices):
    """Picks the backend (module docstring). kind: auto, cuda or sim."""
    kind = (os.environ.get("CUDASHARE_DRIVER", "").strip() or kind or "auto").lower()
    if kind == "sim":
        return SimBackend(device)
    if kind == "cuda":
        return CudaBackend(device)
    if kind != "auto":
        raise ValueError("backend %r: want auto, cuda or sim" % kind)
    try:
        cb = CudaBackend(device, reason="auto: a GPU holds the producer's memory")
    except (NotSupported, DriverError) as e:
        return SimBackend(device, reason="auto: no CUDA driver (%s)" % e)
    try:
        mine = set(cb.device_uuids())
    except DriverError as e:
        cb.shutdown()
        return SimBackend(device, reason="auto: cannot list CUDA devices (%s)" % e)
    if producer_devices and not mine.intersection(producer_devices):
        cb.shutdown()
        return SimBackend(device, reason="auto: the producer's device is no GPU of this machine (a simulated producer)")
    return cb


def stream_handle(stream) -> int:
    """A CUstream value (an int) from what frameworks call a stream:

    - None: the legacy default stream (0); an int: itself;
    - an object with ``__cuda_stream__`` (the CUDA stream protocol, which
      cuda.core's Stream offers): it returns (version, handle);
    - torch.cuda.Stream (``.cuda_stream``), cupy.cuda.Stream (``.ptr``);
    - an object whose ``.handle`` is an int, or converts to one:
      cuda.core's CUstream (int(handle)), Numba's ctypes c_void_p
      (handle.value).

    JAX exposes no stream object of its own: pass an int, or None.
    """
    if stream is None:
        return 0
    if type(stream) is int:
        return stream
    if isinstance(stream, bool):
        raise TypeError("stream %r: a bool is not a CUstream" % (stream,))
    if isinstance(stream, int):
        return int(stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        got = proto() if callable(proto) else proto  # a method since cuda.core 0.2; a property before
        try:
            _version, h = got
            return _as_handle(h)
        except (TypeError, ValueError):
            raise TypeError("stream %r: __cuda_stream__ returned %r, want (version, handle)" % (stream, got)) from None
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if v is not None:
            try:
                return _as_handle(v)
            except TypeError:
                pass
    raise TypeError("stream %r: want a CUstream as int, an object with __cuda_stream__, or one with .cuda_stream, "
                    ".ptr or .handle (torch, CuPy, cuda.core, Numba)" % (stream,))


def _as_handle(v) -> int:
    """An int from a stream's handle: an int, a CUstream object (int() of
    it), a ctypes pointer (its .value; None for the default stream)."""
    if type(v) is int:
        return v
    if isinstance(v, bool):
        raise TypeError("a bool is not a CUstream")
    val = getattr(v, "value", v)  # ctypes.c_void_p
    if val is None:
        return 0
    if isinstance(val, (str, bytes, float, bool)):
        raise TypeError("handle %r is not a CUstream" % (v,))
    try:
        return int(val)
    except (TypeError, ValueError):
        raise TypeError("handle %r is not a CUstream" % (v,)) from None
