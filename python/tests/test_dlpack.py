"""The DLPack capsule protocol on the sim backend (kDLCPU), with a fake
framework that consumes capsules through the CPython C API as torch does:
PyCapsule_GetPointer("dltensor"), rename to "used_dltensor", deleter when
its tensor dies. No leak of slots, leases or memory."""

import ctypes
import gc
import os
import tracemalloc
import weakref

import cudashare
from cudashare import dlpack
from fakeproducer import sim_memfd
from test_fake_producer import MiB2, connected

_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_USED = ctypes.create_string_buffer(b"used_dltensor")


def consume(cap):
    p = _GetPointer(cap, b"dltensor")
    assert _SetName(cap, _USED) == 0
    return p, dlpack.DLManagedTensor.from_address(p)


def lease_of(fake, meta=None, size=4096):
    f, c = connected(fake)
    fd = sim_memfd(MiB2, 5)
    f.offer(1, size=size, offset=8192, kind=1, nfds=1, fds=[fd], meta=meta or {"batch": 1})
    os.close(fd)
    return f, c, c.next(timeout=5)


def test_capsule_contents_and_consumed_protocol(fake):
    f, c, l = lease_of(fake, {"dtype": "float32", "shape": [2, 3, 4]})
    base = dlpack.live()
    cap = l.__dlpack__()
    assert type(cap).__name__ == "PyCapsule" and _IsValid(cap, b"dltensor")
    p, mt = consume(cap)
    t = mt.dl_tensor
    assert t.data == l.ptr and (t.device.device_type, t.device.device_id) == (dlpack.K_DL_CPU, 0)
    assert t.ndim == 3 and [t.shape[i] for i in range(3)] == [2, 3, 4] and not t.strides
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1) and t.byte_offset == 0
    del cap
    gc.collect()
    assert dlpack.live() == base + 1  # consumed: the capsule's end does not delete; the "tensor" holds it
    w = weakref.ref(l)
    l.release()
    del l
    gc.collect()
    assert w() is not None  # the tensor keeps the Lease object alive (its memory is the producer's again)
    mt.deleter(p)  # the tensor dies after the release: safe
    mt.deleter(p)  # a second call is ignored
    gc.collect()
    assert w() is None and dlpack.live() == base
    assert f.recv_until(4) == [4, [1]]
    c.close(timeout=0.5)


def test_unconsumed_capsule_deletes_itself(fake):
    f, c, l = lease_of(fake)
    base = dlpack.live()
    cap = l.__dlpack__()
    t = dlpack.DLManagedTensor.from_address(_GetPointer(cap, b"dltensor")).dl_tensor
    assert t.ndim == 1 and t.shape[0] == 4096 and (t.dtype.code, t.dtype.bits) == (1, 8)
    assert dlpack.live() == base + 1
    del cap, t
    assert dlpack.live() == base
    l.release()
    c.close(timeout=0.5)


def test_no_leak_and_slots_reused(fake):
    f, c, l = lease_of(fake, {"dtype": "uint8", "shape": [64, 64]})
    # Another module changing ctypes.pythonapi's shared prototypes does not matter.
    ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    for _ in range(200):  # warm: slots, templates
        p, mt = consume(l.__dlpack__())
        mt.deleter(p)
        l.__dlpack__()  # dropped unconsumed
    gc.collect()
    slots = len(dlpack._addr)
    tracemalloc.start()
    snap = tracemalloc.take_snapshot()
    for i in range(5000):
        cap = l.__dlpack__()
        if i % 2:
            p, mt = consume(cap)
            del cap
            mt.deleter(p)
        else:
            del cap
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap, "filename"))
    tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert len(dlpack._addr) == slots and dlpack.live() == 0
    held = [l.__dlpack__() for _ in range(100)]  # many at once: more slots, then all back
    assert dlpack.live() == 100
    del held
    assert dlpack.live() == 0
    l.release()
    c.close(timeout=0.5)


def test_released_lease_refuses_dlpack(fake):
    f, c, l = lease_of(fake)
    l.release()
    try:
        l.__dlpack__()
    except cudashare.Closed:
        pass
    else:
        raise AssertionError("no Closed")
    assert dlpack.live() == 0
    c.close(timeout=0.5)
