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


class FakeTensor:
    """What a framework's from_dlpack returns: it takes the capsule through
    the DLPack protocol, as torch does, and calls the deleter when it dies."""

    made = 0

    def __init__(self, obj):
        FakeTensor.made += 1
        cap = obj.__dlpack__(stream=None)
        self.p, mt = consume(cap)
        t = mt.dl_tensor
        self.data = t.data
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.dtype = (t.dtype.code, t.dtype.bits)
        self.deleter = mt.deleter

    def __del__(self):
        self.deleter(self.p)


def fake_from_dlpack(obj):
    return FakeTensor(obj)


def other_from_dlpack(obj):
    return FakeTensor(obj)


def offers_of_one_range(f, c, seqs, meta=None, offset=8192, size=4096, first=True):
    """Offers seqs, one after another, in the same range of allocation 1;
    returns the leases."""
    out = []
    for i, seq in enumerate(seqs):
        if first and i == 0:
            fd = sim_memfd(MiB2, 5)
            f.offer(seq, size=size, offset=offset, kind=1, nfds=1, fds=[fd], meta=meta or {"batch": seq})
            os.close(fd)
        else:
            f.offer(seq, size=size, offset=offset, kind=1, meta=meta or {"batch": seq})
        out.append(c.next(timeout=5))
    return out


def test_array_is_made_once_per_range_and_reused(fake):
    f, c = connected(fake)
    base, made = dlpack.live(), FakeTensor.made
    l1, = offers_of_one_range(f, c, [1])
    v1 = l1.array(fake_from_dlpack)
    assert isinstance(v1, FakeTensor) and v1.data == l1.ptr and v1.shape == (4096,) and v1.dtype == (1, 8)
    assert l1.array(fake_from_dlpack) is v1
    l1.release()
    # The next lease of the same range gets the same view: no capsule, no
    # framework call.
    l2, = offers_of_one_range(f, c, [2], first=False)
    assert l2.array(fake_from_dlpack) is v1 and FakeTensor.made == made + 1
    # Another converter, or another dtype and shape, is another view.
    v2 = l2.array(other_from_dlpack)
    assert v2 is not v1 and v2.data == v1.data
    l2.release()
    l3, = offers_of_one_range(f, c, [3], meta={"batch": 3, "dtype": "float32", "shape": [4, 8]}, first=False)
    v3 = l3.array(fake_from_dlpack)
    assert v3 is not v1 and v3.shape == (4, 8) and v3.dtype == (2, 32)
    assert l3.array(fake_from_dlpack) is v3
    l3.release()
    # A cached view keeps no lease alive.
    w = weakref.ref(l3)
    del l1, l2, l3
    gc.collect()
    assert w() is None
    assert dlpack.live() == base + 3 and FakeTensor.made == made + 3
    # Retire: the consumer drops its views before it unmaps.
    del v1, v2, v3
    f.send([5, 1])
    assert f.recv_until(6) == [6, 1]
    gc.collect()
    assert dlpack.live() == base
    c.close(timeout=0.5)


def test_array_views_die_with_the_consumer(fake):
    f, c = connected(fake)
    base = dlpack.live()
    l, = offers_of_one_range(f, c, [1])
    l.array(fake_from_dlpack)
    l.release()
    assert dlpack.live() == base + 1
    c.close(timeout=0.5)
    gc.collect()
    assert dlpack.live() == base


def test_array_cache_is_bounded(fake):
    """A producer that lends ever new ranges (or a caller with a new
    converter per call) cannot grow the cache past MAX_VIEWS; past it each
    call makes a view that keeps its lease alive, as __dlpack__'s do."""
    f, c = connected(fake, credits=1)
    base = dlpack.live()
    from cudashare import lease as lease_mod
    n = lease_mod.MAX_VIEWS + 3
    fd = sim_memfd(MiB2, 5)
    held = []
    for i in range(n):
        if i == 0:
            f.offer(1, size=256, offset=0, kind=1, nfds=1, fds=[fd], meta={"batch": 1})
            os.close(fd)
        else:
            f.offer(i + 1, size=256, offset=256 * i, kind=1, meta={"batch": i + 1})
        l = c.next(timeout=5)
        v = l.array(fake_from_dlpack)
        assert v.data == l.ptr
        if i >= lease_mod.MAX_VIEWS:
            assert l.array(fake_from_dlpack) is not v  # not cached
            held.append((weakref.ref(l), v))
        l.release()
        del l
    gc.collect()
    assert all(w() is not None for w, _ in held)  # the uncached views keep their leases
    assert dlpack.live() == base + lease_mod.MAX_VIEWS + len(held)
    del held, v
    gc.collect()
    assert dlpack.live() == base + lease_mod.MAX_VIEWS
    c.close(timeout=0.5)
    gc.collect()
    assert dlpack.live() == base


def test_array_of_a_released_lease_and_a_capsule_taken_twice(fake):
    f, c, l = lease_of(fake)
    l.release()
    try:
        l.array(fake_from_dlpack)
    except cudashare.Closed:
        pass
    else:
        raise AssertionError("no Closed")

    def twice(obj):
        obj.__dlpack__()
        obj.__dlpack__()

    f.offer(2, size=4096, offset=8192, kind=1, meta={"batch": 2})
    l2 = c.next(timeout=5)
    try:
        l2.array(twice)
    except BufferError:
        pass
    else:
        raise AssertionError("no BufferError")
    gc.collect()
    assert dlpack.live() == 0
    l2.release()
    c.close(timeout=0.5)
