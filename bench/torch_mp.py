#!/usr/bin/env python3
"""The anchor for cudashare's handoff benchmark: torch.multiprocessing handing
CUDA tensors from a producer process to a consumer process through a queue.

Two modes, the same as cudashare's bench:
  ring   a ring of N reused buffers of SIZE bytes; the consumer sends back the
         index of each buffer it is done with, and the producer reuses it.
  fresh  a fresh tensor of SIZE bytes for every handoff (at most N in flight).
Each handoff: the producer fills the buffer (a memset with the sequence
number), synchronizes, puts it on the queue; the consumer checks one byte on
the device (.item(): one device-to-host copy), and releases it. Prints one
JSON line: handoffs/s, p50 and p99 latency (from put to the consumer's
receipt, both on time.perf_counter, which is CLOCK_MONOTONIC on Linux: the
clock cudashare's consumer uses too).

  python3 bench/torch_mp.py --mode ring --size 1MiB --ring 8
  python3 bench/torch_mp.py --mode fresh --size 64MiB

Exit codes: 0 done (every byte checked was right), 1 a wrong byte or a
failure, 2 usage, 3 no torch or no CUDA device (a JSON line with "skipped"
says which).
"""
import argparse
import json
import re
import sys
import time


def parse_size(s):
    """1048576, 1MiB, 64MiB, 1GiB (K, M, G also mean KiB, MiB, GiB)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b?)\s*", s, re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
        raise argparse.ArgumentTypeError("size %r: want a byte count like 1048576, 1MiB or 64MiB" % s)
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]


def consumer(q, back, n, device):
    import torch
    torch.cuda.set_device(device)
    # Initialize CUDA before saying ready, so that the measured run times
    # handoffs, not this process's start (a spawn plus CUDA context creation
    # take seconds, and counting them cut torch's rate tenfold).
    torch.zeros(1, device="cuda:%d" % device).item()
    back.put("ready")
    lat = []
    bad = 0
    for _ in range(n):
        idx, seq, t0, t = q.get()
        lat.append(time.perf_counter() - t0)
        if int(t[0].item()) != seq % 251:
            bad += 1
        del t
        back.put(idx)
    back.put(("done", lat, bad))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["ring", "fresh"], default="ring")
    ap.add_argument("--size", type=parse_size, default=1 << 20, help="bytes per buffer: 1MiB, 64MiB, ...")
    ap.add_argument("--ring", type=int, default=8, help="ring buffers; fresh: most tensors in flight")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the measured run")
    ap.add_argument("--max", type=int, default=200000, help="most handoffs in the measured run")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--consumer-device", type=int, default=None)
    a = ap.parse_args()
    cdev = a.device if a.consumer_device is None else a.consumer_device
    line = {
        "impl": "torch.multiprocessing", "mode": a.mode, "size": a.size, "ring": a.ring,
        "device": a.device, "consumer_device": cdev, "verify": "byte",
    }

    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        line["skipped"] = "torch is not installed (%s)" % e
        print(json.dumps(line))
        return 3
    if not torch.cuda.is_available() or torch.cuda.device_count() <= max(a.device, cdev):
        line["skipped"] = "torch sees %d CUDA device(s)" % (torch.cuda.device_count() if torch.cuda.is_available() else 0)
        print(json.dumps(line))
        return 3
    line["torch"] = torch.__version__

    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    torch.cuda.set_device(a.device)
    dev = "cuda:%d" % a.device
    ring = [torch.empty(a.size, dtype=torch.uint8, device=dev) for _ in range(a.ring)] if a.mode == "ring" else None

    def run(count):
        p = ctx.Process(target=consumer, args=(q, back, count, cdev))
        p.start()
        if back.get() != "ready":
            raise RuntimeError("the consumer did not start")
        free = list(range(a.ring)) if ring else None
        start = time.perf_counter()
        inflight = 0
        for seq in range(count):
            if ring is not None:
                while not free:
                    free.append(back.get())
                    inflight -= 1
                idx = free.pop()
                t = ring[idx]
            else:
                idx = -1
                # keep the producer from running unboundedly ahead
                while inflight >= a.ring:
                    back.get()
                    inflight -= 1
                t = torch.empty(a.size, dtype=torch.uint8, device=dev)
            t.fill_(seq % 251)
            torch.cuda.current_stream().synchronize()
            q.put((idx, seq, time.perf_counter(), t))
            inflight += 1
            del t
        while True:
            m = back.get()
            if isinstance(m, tuple) and m[0] == "done":
                _, lat, bad = m
                break
        elapsed = time.perf_counter() - start
        p.join()
        if p.exitcode != 0:
            raise RuntimeError("the consumer process exited with %s" % p.exitcode)
        return elapsed, lat, bad

    # A short probe run sizes the measured run to about --seconds.
    probe = 200 if a.mode == "ring" else 40
    el, _, _ = run(probe)
    n = max(probe, min(a.max, int(probe / el * a.seconds)))
    el, lat, bad = run(n)
    lat.sort()
    line.update({
        "handoffs": n, "seconds": round(el, 3),
        "handoffs_per_s": round(n / el, 1),
        "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
        "verify_errors": bad,
    })
    print(json.dumps(line))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
