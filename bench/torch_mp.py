#!/usr/bin/env python3
"""The anchor for cudashare's handoff benchmark: torch.multiprocessing handing
CUDA tensors from a producer process to a consumer process through a queue.

Two modes, the same as cudashare's bench:
  ring   a ring of N reused buffers of SIZE bytes; the consumer sends back the
         index of each buffer it is done with, and the producer reuses it.
  fresh  a fresh tensor of SIZE bytes for every handoff.
Each handoff: the producer fills the buffer (a memset with the sequence
number), puts it on the queue; the consumer checks one byte on the device,
and releases it. Prints one JSON line: handoffs/s, p50 and p99 latency (from
put to the consumer's receipt, on one host clock).
"""
import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp


def consumer(q, back, n, device):
    torch.cuda.set_device(device)
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ring", "fresh"], default="ring")
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--ring", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max", type=int, default=200000)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--consumer-device", type=int, default=None)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    torch.cuda.set_device(a.device)
    cdev = a.device if a.consumer_device is None else a.consumer_device
    ring = [torch.empty(a.size, dtype=torch.uint8, device=f"cuda:{a.device}") for _ in range(a.ring)] if a.mode == "ring" else None
    def run(count):
        p = ctx.Process(target=consumer, args=(q, back, count, cdev))
        p.start()
        free = list(range(a.ring)) if ring else None
        start = time.perf_counter()
        inflight = 0
        for seq in range(count):
            if ring is not None:
                while not free:
                    m = back.get()
                    free.append(m)
                    inflight -= 1
                idx = free.pop()
                t = ring[idx]
            else:
                idx = -1
                t = torch.empty(a.size, dtype=torch.uint8, device=f"cuda:{a.device}")
                # keep the producer from running unboundedly ahead
                while inflight >= a.ring:
                    back.get()
                    inflight -= 1
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
        return elapsed, lat, bad

    # A short probe run sizes the measured run to about --seconds.
    probe = 200 if a.mode == "ring" else 40
    el, _, _ = run(probe)
    rate = probe / el
    n = max(probe, min(a.max, int(rate * a.seconds)))
    el, lat, bad = run(n)
    lat.sort()
    print(json.dumps({
        "impl": "torch.multiprocessing",
        "mode": a.mode, "size": a.size, "ring": a.ring,
        "device": a.device, "consumer_device": cdev,
        "handoffs": n, "seconds": round(el, 3),
        "handoffs_per_s": round(n / el, 1),
        "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
        "bad": bad,
    }))


if __name__ == "__main__":
    main()
