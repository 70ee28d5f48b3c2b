#!/usr/bin/env python3
"""Raw CUDA IPC from Python, done by hand: what cudashare replaces.

A producer process allocates a ring of N buffers of SIZE bytes with CuPy
(cupy.cuda.runtime.malloc: one cudaMalloc each, so that each IPC handle names
exactly one buffer; CuPy's memory pool would hand out pieces of larger
allocations), takes their IPC handles once (ipcGetMemHandle), and makes one
interprocess event per buffer. A consumer process (multiprocessing, spawn)
gets the buffers over a multiprocessing Pipe, pipelined: up to N in flight.

Each handoff: the producer fills the buffer on its stream (cudaMemsetAsync
of a byte derived from the sequence number) and, with --sync event (the
default), records the buffer's interprocess event on that stream, then sends
(index, seq, send time, memory handle, event handle). The consumer opens a
memory handle the first time it sees it and caches the pointer by handle
(the hand-written cache), likewise the event; it makes its stream wait on the
event, and sends the index back: the release. With --sync host the producer
synchronizes its stream before sending and the consumer waits on nothing.
With --verify byte the consumer copies the first byte of each buffer back
(cudaMemcpyAsync to pinned memory on its stream, then synchronizes) and
checks it: what bench/torch_mp.py's .item() and cudashare's -verify byte do.
With --no-fill there is no GPU work at all (no fill, no event, no wait): the
handoff alone, as cudashare's -fill=false -verify none.

Prints one JSON line: handoffs/s (releases received in the measured run),
p50 and p99 latency (from the send to the consumer's receipt, both on
time.perf_counter: CLOCK_MONOTONIC, as cudashare's consumer and torch_mp.py).

  python3 bench/cupy_ipc.py --ring 8 --size 1MiB --seconds 4
  python3 bench/cupy_ipc.py --verify byte --device 0 --consumer-device 1

Exit codes: 0 done (every byte checked was right), 1 a wrong byte or a
failure, 2 usage, 3 no CuPy or not enough CUDA devices (a JSON line with
"skipped" says which).
"""
import argparse
import collections
import ctypes
import json
import re
import sys
import time

CUDA_EVENT_DISABLE_TIMING = 2
CUDA_EVENT_INTERPROCESS = 4
CUDA_STREAM_NON_BLOCKING = 1
CUDA_MEMCPY_DEVICE_TO_HOST = 2


def parse_size(s):
    """1048576, 1MiB, 64MiB, 1GiB (K, M, G also mean KiB, MiB, GiB)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b?)\s*", s, re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
        raise argparse.ArgumentTypeError("size %r: want a byte count like 1048576, 1MiB or 64MiB" % s)
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]


def pattern(seq):
    return seq % 251 + 1


def quantile(xs, q):
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def consumer(conn, device, sync, verify):
    import cupy
    rt = cupy.cuda.runtime
    try:
        rt.setDevice(device)
        stream = rt.streamCreateWithFlags(CUDA_STREAM_NON_BLOCKING)
        host = rt.hostAlloc(1, 0)  # pinned: the one-byte readback
        hbyte = ctypes.c_ubyte.from_address(host)
    except Exception as e:  # noqa: BLE001 - reported to the producer
        conn.send(("error", "consumer setup: %r" % (e,)))
        return
    conn.send("ready")
    mems, events = {}, {}  # the hand-written cache: handle bytes -> pointer / event
    lat = []
    bad = 0
    try:
        while True:
            m = conn.recv()
            if m[0] == "stop":
                first = m[1]
                break
            i, seq, t0, mh, eh = m
            lat.append((seq, time.perf_counter() - t0))
            p = mems.get(mh)
            if p is None:
                p = mems[mh] = rt.ipcOpenMemHandle(mh)
            if sync == "event":
                e = events.get(eh)
                if e is None:
                    e = events[eh] = rt.ipcOpenEventHandle(eh)
                rt.streamWaitEvent(stream, e, 0)
            if verify == "byte":
                rt.memcpyAsync(host, p, 1, CUDA_MEMCPY_DEVICE_TO_HOST, stream)
                rt.streamSynchronize(stream)
                if hbyte.value != pattern(seq):
                    bad += 1
            conn.send(i)
        rt.streamSynchronize(stream)
        ls = sorted(t for s, t in lat if s >= first)
        out = {"received": len(lat), "measured": len(ls), "bad": bad, "opens": len(mems), "event_opens": len(events),
               "p50_us": None if not ls else round(quantile(ls, 0.5) * 1e6, 1),
               "p99_us": None if not ls else round(quantile(ls, 0.99) * 1e6, 1)}
        for p in mems.values():
            rt.ipcCloseMemHandle(p)
        for e in events.values():
            rt.eventDestroy(e)
        rt.streamDestroy(stream)
        rt.freeHost(host)
        conn.send(("done", out))
    except Exception as e:  # noqa: BLE001 - reported to the producer
        conn.send(("error", "consumer: %r" % (e,)))


def recv(conn, what):
    if not conn.poll(60):
        raise RuntimeError("no %s from the consumer within 60 s" % what)
    m = conn.recv()
    if isinstance(m, tuple) and m[0] == "error":
        raise RuntimeError(m[1])
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=1 << 20, help="bytes per buffer: 1MiB, 64MiB, ...")
    ap.add_argument("--ring", type=int, default=8, help="buffers in the ring: the most in flight")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of the measured run")
    ap.add_argument("--warmup", type=float, default=0.3, help="seconds of handoffs before the measured run")
    ap.add_argument("--sync", choices=["event", "host"], default="event",
                    help="event: an interprocess event per buffer, waited on by the consumer's stream; host: the producer synchronizes its stream before sending")
    ap.add_argument("--verify", choices=["none", "byte"], default="none", help="byte: the consumer copies one byte of each buffer back and checks it")
    ap.add_argument("--no-fill", action="store_true", help="no fill, no event, no wait: the handoff alone (with --verify none)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--consumer-device", type=int, default=None)
    a = ap.parse_args()
    if a.ring < 1 or a.seconds <= 0 or a.warmup < 0:
        ap.error("want --ring >= 1, --seconds > 0, --warmup >= 0")
    if a.no_fill:
        if a.verify != "none":
            ap.error("--no-fill writes nothing to check: use --verify none")
        a.sync = "none"
    cdev = a.device if a.consumer_device is None else a.consumer_device
    line = {
        "impl": "cupy", "mode": "ring", "size": a.size, "ring": a.ring, "device": a.device,
        "consumer_device": cdev, "verify": a.verify, "sync": a.sync, "gpu_work": "none" if a.no_fill else "fill",
    }
    try:
        import cupy
    except ImportError as e:
        line["skipped"] = "cupy is not installed (%s)" % e
        print(json.dumps(line))
        return 3
    rt = cupy.cuda.runtime
    try:
        n = rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver or no device
        n, line["skipped"] = 0, "CuPy sees no CUDA device (%s)" % e
    if n <= max(a.device, cdev):
        line.setdefault("skipped", "CuPy sees %d CUDA device(s)" % n)
        print(json.dumps(line))
        return 3
    line["cupy"] = cupy.__version__

    import multiprocessing as mp
    rt.setDevice(a.device)
    stream = rt.streamCreateWithFlags(CUDA_STREAM_NON_BLOCKING)
    ptrs = [rt.malloc(a.size) for _ in range(a.ring)]
    mhs = [rt.ipcGetMemHandle(p) for p in ptrs]
    evs = [rt.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING | CUDA_EVENT_INTERPROCESS) for _ in range(a.ring)]
    ehs = [rt.ipcGetEventHandle(e) for e in evs]

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe(duplex=True)
    p = ctx.Process(target=consumer, args=(child, cdev, a.sync, a.verify))
    p.start()
    try:
        if recv(conn, "ready message") != "ready":
            raise RuntimeError("the consumer did not start")
        free = collections.deque(range(a.ring))
        seq = 0
        released = 0
        first = None
        start = time.perf_counter()
        t0 = None
        while True:
            now = time.perf_counter()
            if first is None and now - start >= a.warmup:
                first, t0, released = seq, now, 0
            if t0 is not None and now - t0 >= a.seconds:
                break
            if free:
                i = free.popleft()
                if not a.no_fill:
                    rt.memsetAsync(ptrs[i], pattern(seq), a.size, stream)
                if a.sync == "event":
                    rt.eventRecord(evs[i], stream)
                elif a.sync == "host":
                    rt.streamSynchronize(stream)
                conn.send((i, seq, time.perf_counter(), mhs[i], ehs[i]))
                seq += 1
            else:
                free.append(recv(conn, "release"))
                released += 1
        elapsed = time.perf_counter() - t0
        for _ in range(a.ring - len(free)):
            free.append(recv(conn, "release"))
        conn.send(("stop", first))
        m = recv(conn, "report")
        if not (isinstance(m, tuple) and m[0] == "done"):
            raise RuntimeError("unexpected message from the consumer: %r" % (m,))
        out = m[1]
    except Exception as e:  # noqa: BLE001 - reported in the JSON line
        line["error"] = str(e)
        print(json.dumps(line))
        p.kill()
        return 1
    finally:
        p.join(30)
    rt.streamSynchronize(stream)
    for e in evs:
        rt.eventDestroy(e)
    for q in ptrs:
        rt.free(q)
    rt.streamDestroy(stream)
    line.update({
        "handoffs": released, "seconds": round(elapsed, 3), "handoffs_per_s": round(released / elapsed, 1),
        "p50_us": out["p50_us"], "p99_us": out["p99_us"], "verify_errors": out["bad"],
        "mappings": out["opens"], "event_opens": out["event_opens"],
    })
    if p.exitcode not in (0, None):
        line["error"] = "the consumer process exited with %s" % p.exitcode
    print(json.dumps(line))
    return 1 if out["bad"] or "error" in line else 0


if __name__ == "__main__":
    sys.exit(main())
