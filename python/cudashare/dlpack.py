"""A DLPack capsule built with ctypes (DLPack 0.8 ABI, unversioned
"dltensor" capsule), so that torch.from_dlpack, cupy.from_dlpack and
jax.dlpack take a lease without a copy and without either package here.

The capsule owns a DLManagedTensor whose manager context keeps the Lease
object alive: a lease that a framework still views is never released by
the garbage collector behind it. The deleter runs when the framework lets
go; the capsule's destructor calls it if no framework ever took it.
"""

import ctypes
import threading

K_DL_CPU = 1
K_DL_CUDA = 2


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


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _Deleter)]

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_NAME = b"dltensor"
_live = {}  # address of the DLManagedTensor -> what it keeps alive
_lock = threading.Lock()


def _delete(p):
    with _lock:
        _live.pop(ctypes.cast(p, ctypes.c_void_p).value, None)


_deleter = _Deleter(_delete)


def _destroy(capsule):
    # A capsule no framework consumed is still named "dltensor"; a consumed
    # one was renamed "used_dltensor" and its deleter is the framework's job.
    if _api.PyCapsule_IsValid(capsule, _NAME):
        p = _api.PyCapsule_GetPointer(capsule, _NAME)
        _deleter(ctypes.cast(p, ctypes.POINTER(DLManagedTensor)))


_destructor = _CapsuleDestructor(_destroy)


def capsule(ptr, shape, code_bits, device_type, device_id, keep):
    """Returns a "dltensor" capsule for a C-order tensor at ptr."""
    nd = len(shape)
    shp = (ctypes.c_int64 * max(nd, 1))(*shape)
    mt = DLManagedTensor()
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = DLDevice(device_type, device_id)
    mt.dl_tensor.ndim = nd
    mt.dl_tensor.dtype = DLDataType(code_bits[0], code_bits[1], 1)
    mt.dl_tensor.shape = shp
    mt.dl_tensor.strides = None  # compact, C order
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _deleter
    addr = ctypes.addressof(mt)
    with _lock:
        _live[addr] = (mt, shp, keep)
    return _api.PyCapsule_New(addr, _NAME, _destructor)


def live():
    """How many capsules or framework tensors still hold a lease."""
    with _lock:
        return len(_live)
