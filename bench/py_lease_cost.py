#!/usr/bin/env python3
"""bench/py_lease_cost.py: where a Python consumer's time per lease goes.

Against the Go example producer (ring of 8 x 1 MiB with -fill and an
interprocess event: the default), in the main thread, each step of each
lease is timed with time.perf_counter and the means are printed per lease:

  next         Consumer.next(): reading and checking the offer (this package)
  __dlpack__   the capsule, and the consumer's stream made to wait on the
               producer's event (one cuStreamWaitEvent)
  from_dlpack  torch.from_dlpack of the capsule (torch)
  op           the torch work: acc.add_(x.narrow(0, 0, 16)) (torch)
  del          dropping the tensor (DLPack deleter)
  release      lease.release(stream=...): one cuEventRecord of an
               interprocess event, and the release message (batched)

--group N takes and releases leases N at a time (Consumer.next_many and
release_many: one release message and one event record per group); the
columns stay per lease. thread-cpu is this thread's CPU time per lease.
--backend sim measures the package alone on the simulator (modes release
and host, no torch): next, release and thread-cpu.

--mode picks the steps: "release" (next and a stream-ordered release
only), "dlpack" (and the tensor, no op), "op" (everything: the
benchmark's per-batch torch work, the old way), "array" (the same with
lease.array(torch.from_dlpack, stream), the benchmark's way now: its time
is in the __dlpack__ column; from_dlpack and del are then zero), "host"
(next and a host release).
The means are CPU time of this thread while it is the bound (the
producer outruns one Python consumer); when next() grows, the
producer or the GPU is the bound instead.

    .gpu/bin/producer -socket $S -duration 3s &
    python3 bench/py_lease_cost.py --socket $S --mode op

Prints one line: mode, leases/s, and the mean microseconds of each step.
Needs torch and a GPU (exit 3 without).
"""

import argparse
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("PYPKG") or os.path.join(here, "..", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mode", choices=["release", "dlpack", "op", "array", "host"], default="op")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--wait", type=float, default=20.0)
    ap.add_argument("--group", type=int, default=0, metavar="N",
                    help="take and release leases in groups of up to N (Consumer.next_many, release_many); "
                         "the means are still per lease")
    ap.add_argument("--backend", choices=["cuda", "sim"], default="cuda",
                    help="sim: the package's own time on the simulator, no torch (modes release and host)")
    a = ap.parse_args()
    if a.backend == "sim":
        if a.mode not in ("release", "host"):
            print("py_lease_cost: --backend sim runs modes release and host only")
            return 2
        return sim(a)
    try:
        import torch
    except ImportError as e:
        print("py_lease_cost: skipped: no torch (%s)" % e)
        return 3
    if not torch.cuda.is_available():
        print("py_lease_cost: skipped: torch sees no GPU")
        return 3
    import cudashare

    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)
    sp = stream.cuda_stream
    acc = torch.zeros(16, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    c = cudashare.connect(a.socket, device=a.device, credits=8, wait=a.wait, backend="cuda")
    pc = time.perf_counter
    tensor = a.mode in ("dlpack", "op")
    T = [0.0] * 6
    n = 0
    t0 = t1 = cpu0 = None
    rel_stream = None if a.mode == "host" else sp
    with torch.cuda.stream(stream):
        while True:
            s0 = pc()
            try:
                group = c.next_many(a.group) if a.group else [c.next()]
            except cudashare.Closed:
                break
            sn = pc()
            T[0] += sn - s0
            if t0 is None:
                t0 = sn
                cpu0 = time.thread_time()
            for lease in group:
                s1 = pc()
                if a.mode == "array":
                    x = lease.array(torch.from_dlpack, sp)
                    s2 = s3 = pc()
                    acc.add_(x.narrow(0, 0, 16))
                    s4 = pc()
                    del x
                elif tensor:
                    cap = lease.__dlpack__(stream=sp)
                    s2 = pc()
                    x = torch.from_dlpack(cap)
                    s3 = pc()
                    if a.mode == "op":
                        acc.add_(x.narrow(0, 0, 16))
                    s4 = pc()
                    del x, cap
                else:
                    s2 = s3 = s4 = s1
                T[1] += s2 - s1
                T[2] += s3 - s2
                T[3] += s4 - s3
                T[4] += pc() - s4
            s5 = pc()
            if a.group:
                c.release_many(group, stream=rel_stream)  # one event record, one message
            else:
                group[0].release(stream=rel_stream)
            s6 = pc()
            T[5] += s6 - s5
            n += len(group)
            t1 = s6
    cpu = time.thread_time() - cpu0 if cpu0 is not None else 0.0
    stream.synchronize()
    c.close()
    if n < 2:
        print("py_lease_cost: %d leases" % n)
        return 1
    names = ["next", "__dlpack__", "from_dlpack", "op", "del", "release"]
    mode = a.mode + (" group %d" % a.group if a.group else "")
    print("%-8s %7d/s  " % (mode, n / (t1 - t0)) + "  ".join("%s %.2f" % (k, v / n * 1e6) for k, v in zip(names, T))
          + "  thread-cpu %.2f" % (cpu / n * 1e6))
    return 0


def sim(a):
    """The package's own time on the simulator: next and release only (the
    simulator's release ignores the stream: no event is recorded)."""
    import cudashare
    c = cudashare.connect(a.socket, device=a.device, credits=8, wait=a.wait, backend="sim")
    pc = time.perf_counter
    T = [0.0, 0.0]
    n = 0
    t0 = t1 = None
    stream = None if a.mode == "host" else 7
    cpu0 = None
    while True:
        s0 = pc()
        try:
            if a.group:
                leases = c.next_many(a.group)
            else:
                lease = c.next()
        except cudashare.Closed:
            break
        s1 = pc()
        if t0 is None:
            t0 = s1
            cpu0 = time.thread_time()
        if a.group:
            c.release_many(leases, stream=stream)
            k = len(leases)
        else:
            lease.release(stream=stream)
            k = 1
        s2 = pc()
        T[0] += s1 - s0
        T[1] += s2 - s1
        n += k
        t1 = s2
    cpu = time.thread_time() - cpu0
    c.close()
    if n < 2:
        print("py_lease_cost: %d leases" % n)
        return 1
    print("sim-%s%s %7d/s  next %.2f  release %.2f  thread-cpu %.2f  (us per lease, simulator)" % (
        a.mode, " group %d" % a.group if a.group else "", n / (t1 - t0), T[0] / n * 1e6, T[1] / n * 1e6,
        cpu / n * 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
