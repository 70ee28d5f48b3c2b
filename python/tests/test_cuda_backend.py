"""CudaBackend against a stand-in libcuda made of ctypes callbacks (no GPU
here): functions bound once, the context made current once per thread and
again after a failure, errors naming the function and code, and the
per-lease calls (wait_event, record) one driver call each."""

import ctypes
import threading
import types

import pytest

from cudashare import _backends as backends
from cudashare import DriverError

CTX = 0xC0DE
EVH = bytes(range(64))


def fake_lib():
    calls = []
    state = {"cur": {}, "fail": {}, "events": 0}

    def cb(name, fn):
        proto = ctypes.CFUNCTYPE(ctypes.c_int, *backends._SIGS[name])

        def wrapped(*a):
            calls.append((name, threading.get_ident()))
            r = state["fail"].get(name)
            if r:
                if isinstance(r, list):
                    r = r.pop(0) if r else 0
                if r:
                    return r
            return fn(*a) or 0
        return proto(wrapped)

    def set_current(ctx):
        state["cur"][threading.get_ident()] = ctx

    def need_ctx(fn):
        def f(*a):
            if state["cur"].get(threading.get_ident()) != CTX:
                return 201  # CUDA_ERROR_INVALID_CONTEXT
            return fn(*a)
        return f

    def ev_create(p, flags):
        state["events"] += 1
        p[0] = 0xE000 + state["events"]

    def ipc_get(h, ev):
        ctypes.memmove(h, EVH, 64)

    def err_string(code, s):
        s[0] = b"fake error %d" % code

    def uuid(u, d):
        ctypes.memmove(u, state.get("uuid", b"U" * 16), 16)

    def retain(p, d):
        p[0] = CTX

    impl = {
        "cuInit": lambda f: 0, "cuDeviceGet": lambda p, i: p.__setitem__(0, i),
        "cuDeviceGetCount": lambda p: p.__setitem__(0, 1), "cuDeviceGetUuid": uuid,
        "cuDevicePrimaryCtxRetain": retain, "cuDevicePrimaryCtxRelease_v2": lambda d: 0,
        "cuCtxSetCurrent": set_current, "cuGetErrorString": err_string,
        "cuEventCreate": need_ctx(ev_create), "cuIpcGetEventHandle": need_ctx(ipc_get),
    }
    lib = types.SimpleNamespace()
    for name in backends._SIGS:
        setattr(lib, name, cb(name, impl.get(name, need_ctx(lambda *a: 0))))
    return lib, calls, state


def names(calls, tid=None):
    return [n for n, t in calls if tid is None or t == tid]


def test_context_once_per_thread_and_per_lease_calls():
    lib, calls, state = fake_lib()
    b = backends.CudaBackend(0, lib=lib)
    assert b.device_uuid == b"U" * 16 and b.ctx == CTX
    del calls[:]
    ev, h = b.new_release_event()
    assert h == EVH
    assert names(calls) == ["cuCtxSetCurrent", "cuEventCreate", "cuIpcGetEventHandle"]
    del calls[:]
    for _ in range(100):
        b.wait_event(0xAB, 7)
        b.record(ev, 7)
    assert names(calls) == ["cuStreamWaitEvent", "cuEventRecord"] * 100  # no context call, no handle call

    out = []
    t = threading.Thread(target=lambda: (b.record(ev, 7), b.record(ev, 7), out.append(threading.get_ident())))
    t.start()
    t.join()
    assert names(calls, out[0]) == ["cuCtxSetCurrent", "cuEventRecord", "cuEventRecord"]
    b.shutdown()


def test_uuid_with_a_zero_byte_is_read_whole():
    # An H100 whose UUID began 7f 00 was once taken for a simulated device:
    # a c_char array's value stops at the first zero byte.
    lib, calls, state = fake_lib()
    want = bytes([0x7F, 0x00, 0xE0, 0x6C]) + bytes(range(1, 13))
    state["uuid"] = want
    b = backends.CudaBackend(0, lib=lib)
    assert b.device_uuid == want
    assert b.device_uuids() == [want]
    b.shutdown()


def test_context_switched_behind_the_backend_is_restored_once():
    lib, calls, state = fake_lib()
    b = backends.CudaBackend(0, lib=lib)
    b.wait_event(1, 2)
    state["cur"][threading.get_ident()] = 0x0BAD  # another library switched this thread's context
    del calls[:]
    b.wait_event(1, 2)
    assert names(calls) == ["cuStreamWaitEvent", "cuCtxSetCurrent", "cuStreamWaitEvent"]
    del calls[:]
    b.wait_event(1, 2)
    assert names(calls) == ["cuStreamWaitEvent"]


def test_errors_name_the_function_and_code():
    lib, calls, state = fake_lib()
    b = backends.CudaBackend(0, lib=lib)
    b.record(1, 2)
    state["fail"]["cuEventRecord"] = 400
    with pytest.raises(DriverError) as ei:
        b.record(1, 2)
    e = ei.value
    assert "cuEventRecord" in str(e) and "400" in str(e) and "fake error 400" in str(e)
    state["fail"]["cuEventRecord"] = [400]  # fails once: the retry after making the context current succeeds
    b.record(1, 2)
    state["fail"] = {"cuCtxSetCurrent": 3}
    b2 = backends.CudaBackend(0, lib=lib)
    out = []

    def other():
        try:
            b2.wait_event(1, 2)
        except DriverError as e:
            out.append(e)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert out and "cuCtxSetCurrent" in str(out[0]) and "3" in str(out[0])
    state["fail"] = {}
    b2.wait_event(1, 2)  # the flag was not set: made current now
