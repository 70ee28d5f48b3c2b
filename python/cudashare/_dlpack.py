"""A DLPack capsule built with ctypes (DLPack 0.8 ABI, unversioned
"dltensor" capsule), so that torch.from_dlpack, cupy.from_dlpack and
jax.dlpack take a lease without a copy and without either package here.

Per capsule, one DLManagedTensor comes from a free list of slots (each
slot: the struct, then room for 32 dimensions), filled from a template
made once per (shape, dtype, device): a copy of bytes and two stores. The
slot keeps the Lease object alive, so a lease that a framework still views
is never released by the garbage collector behind it. Its deleter (the
framework calls it when the tensor is freed; the capsule's destructor
calls it if no framework consumed the capsule, that is when the capsule is
still named "dltensor") drops that reference and returns the slot.

The tensor is a view of the lease's memory, valid until the lease is
released (Lease's contract): after lease.release() the producer rewrites
the buffer, whatever the framework still holds. Slot memory is never
freed (it is reused; its count is the most capsules and tensors alive at
once), so a deleter called after the release, or after the consumer's
close, is still safe.

The CPython functions are private prototypes (PYFUNCTYPE), not
ctypes.pythonapi's shared function objects, whose argtypes any other
module may change.
"""

import ctypes
import struct
import threading

K_DL_CPU = 1
K_DL_CUDA = 2
MAX_NDIM = 32


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


# void (*deleter)(DLManagedTensor *self): the argument arrives as an int.
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _Deleter)]

_MT = ctypes.sizeof(DLManagedTensor)        # 64 on LP64
_SLOT = _MT + 8 * MAX_NDIM
_OFF_SHAPE = DLTensor.shape.offset          # 24
_OFF_DEV = DLTensor.device.offset           # 8
_Q = struct.Struct("=Q")
_CHUNK = 64

_pyapi = ctypes.pythonapi
_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
    ("PyCapsule_New", _pyapi))
_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(("PyCapsule_IsValid", _pyapi))
_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(("PyCapsule_GetPointer", _pyapi))

_NAME_BUF = ctypes.create_string_buffer(b"dltensor")  # lives as long as the module: capsules keep the pointer
_NAME = ctypes.addressof(_NAME_BUF)

_lock = threading.Lock()   # growing the slots, and the template cache
_chunks = []               # slot memory, never freed
_addr = []                 # slot index -> address
_mv = []                   # slot index -> writable memoryview of the slot
_keep = []                 # slot index -> what the tensor keeps alive (None: free)
_index = {}                # address -> slot index
_free = []                 # free slot indices
_templates = {}            # (shape, (code, bits), device_type, device_id) -> bytes from offset 8
MAX_TEMPLATES = 1024


def _delete(p):
    i = _index.get(p)
    if i is None or _keep[i] is None:
        return  # not a slot of ours, or deleted already (a second call is ignored)
    _keep[i] = None
    _free.append(i)


_deleter = _Deleter(_delete)
_DELETER = ctypes.cast(_deleter, ctypes.c_void_p).value


def _destroy(cap):
    # A capsule no framework consumed is still named "dltensor"; a consumed
    # one was renamed "used_dltensor" and its deleter is the framework's job.
    try:
        if _IsValid(cap, _NAME):
            _delete(_GetPointer(cap, _NAME))
    except Exception:
        pass


_destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_destroy)
_DESTRUCTOR = ctypes.cast(_destructor, ctypes.c_void_p).value


def _grow():
    with _lock:
        if _free:
            return _free.pop()
        buf = (ctypes.c_char * (_SLOT * _CHUNK))()
        _chunks.append(buf)
        base = ctypes.addressof(buf)
        whole = memoryview(buf).cast("B")
        n = len(_addr)
        for k in range(_CHUNK):
            a = base + k * _SLOT
            _addr.append(a)
            _mv.append(whole[k * _SLOT:(k + 1) * _SLOT])
            _keep.append(None)
            _index[a] = n + k
        _free.extend(range(n + _CHUNK - 1, n, -1))
        return n


def _template(key):
    shape, (code, bits), dt, did = key
    nd = len(shape)
    if nd > MAX_NDIM:
        raise ValueError("%d dimensions, DLPack slots hold %d" % (nd, MAX_NDIM))
    # From offset 8: device, ndim, dtype, shape pointer (set per slot),
    # strides NULL (compact, C order), byte_offset 0, manager_ctx NULL,
    # deleter; then the shape.
    t = struct.pack("=iiiBBHQQQQQ", dt, did, nd, code, bits, 1, 0, 0, 0, 0, _DELETER)
    t += struct.pack("=%dq" % nd, *shape)
    assert len(t) == _MT - 8 + 8 * nd
    with _lock:
        if len(_templates) < MAX_TEMPLATES:
            _templates[key] = t
    return t


def capsule(ptr, shape, code_bits, device_type, device_id, keep):
    """Returns a "dltensor" capsule for a C-order tensor at ptr; the
    tensor keeps keep (not None) alive until its deleter runs."""
    key = (shape, code_bits, device_type, device_id)
    t = _templates.get(key)
    if t is None:
        t = _template(key)
    try:
        i = _free.pop()
    except IndexError:
        i = _grow()
    a = _addr[i]
    mv = _mv[i]
    mv[8:8 + len(t)] = t
    _Q.pack_into(mv, 0, ptr or 0)
    _Q.pack_into(mv, _OFF_SHAPE, a + _MT)
    _keep[i] = keep
    try:
        return _New(a, _NAME, _DESTRUCTOR)
    except BaseException:
        _delete(a)
        raise


def live():
    """How many capsules or framework tensors still hold a lease."""
    return len(_addr) - len(_free)
