#!/usr/bin/env python3
"""bench/py_dlpack_loop.py: the per-lease DLPack cost without a framework.

For each lease: __dlpack__(stream=...), then what a framework's from_dlpack
does with the capsule through the C API (PyCapsule_GetPointer "dltensor",
rename to "used_dltensor", read the DLTensor), then the framework's "tensor
freed" (the DLManagedTensor's deleter), and the release. On the sim backend
the capsule is a kDLCPU tensor; on cuda, the stream is --stream (0: the
legacy default stream) and the release is stream-ordered on it.

  CUDASHARE_DRIVER=sim PYTHONPATH=python python3 bench/py_dlpack_loop.py --socket S --wait 5

Prints one JSON line: handoffs, handoffs_per_s, and dlpack_live at the end
(capsules or tensors still holding a lease: must be 0).
"""

import argparse
import ctypes
import json
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))

import cudashare  # noqa: E402
from cudashare import _dlpack as dlpack  # noqa: E402

# Private prototypes (ctypes.pythonapi's function objects are shared).
_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
_USED = ctypes.create_string_buffer(b"used_dltensor")  # PyCapsule_SetName keeps the pointer: must outlive the capsule


def take(cap):
    """A framework's from_dlpack: consume the capsule, return the address
    of its DLManagedTensor and the struct (the framework calls its deleter
    when the tensor dies)."""
    p = _GetPointer(cap, b"dltensor")
    if _SetName(cap, _USED):
        raise RuntimeError("PyCapsule_SetName")
    return p, dlpack.DLManagedTensor.from_address(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--wait", type=float, default=5.0)
    ap.add_argument("--credits", type=int, default=8)
    ap.add_argument("--stream", type=int, default=0)
    ap.add_argument("--batches", type=int, default=0)
    ap.add_argument("--no-dlpack", action="store_true", help="only release: the loop's cost without DLPack")
    a = ap.parse_args()
    c = cudashare.connect(a.socket, credits=a.credits, wait=a.wait)
    host = c.backend == "sim"
    n = 0
    t0 = t1 = None
    try:
        for lease in c:
            if t0 is None:
                t0 = time.monotonic_ns()
            if a.no_dlpack:
                pass
            else:
                p, mt = take(lease.__dlpack__(stream=None if host else a.stream))
                if mt.dl_tensor.data != lease.ptr:
                    raise SystemExit("capsule data %#x, lease ptr %#x" % (mt.dl_tensor.data, lease.ptr))
                mt.deleter(p)  # the tensor is freed
            if host:
                lease.release()
            else:
                lease.release(stream=a.stream)
            n += 1
            t1 = time.monotonic_ns()
            if a.batches and n >= a.batches:
                break
    finally:
        c.close()
    rep = {"impl": "cudashare-python-dlpack-loop", "driver": c.backend, "handoffs": n,
           "handoffs_per_s": round(n / ((t1 - t0) / 1e9), 1) if n > 1 and t1 > t0 else 0.0,
           "dlpack_live": dlpack.live()}
    print(json.dumps(rep))
    return 0 if rep["dlpack_live"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
