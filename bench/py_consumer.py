#!/usr/bin/env python3
"""bench/py_consumer.py: the Python consumer with torch work per batch, for
bench/gpu-bench.sh and bench/python-gpu-check.sh.

Against the Go example producer (ring or fresh, with -fill: every byte of
batch n is n % 251 + 1, PROTOCOL.md 4.2), for each lease: a tensor of the
lease with no copy (the consumer's stream made to wait on the producer's
event), a small torch op on that stream, and a stream-ordered release
(lease.release(stream=...)): no host sync per batch.

  --view array  (default) lease.array(torch.from_dlpack, stream): the tensor
                of each ring buffer is made once and reused.
  --view dlpack  torch.from_dlpack(lease.__dlpack__(stream)): a DLPack
                capsule and a new tensor per lease.

  --work sum    (default) sums the first --bytes bytes of the batch into a
                device accumulator; at the end the accumulator is compared
                with the sum the batch numbers say (one host sync, at the
                end): the benchmark row.
  --work full   checks every byte of every batch on the GPU ((x != want)
                summed into a device counter): the correctness check.

Prints one JSON line with the keys of the Go consumer's report
(handoffs_per_s, p50_us, p99_us, verified, verify_errors, driver, ...).
Exit 0 ok, 1 wrong data or failure (cudashare's CUDA backend failing where
torch sees a GPU included), 3 skipped (no torch, no GPU for torch; the line
says why), 4 no producer.
"""

import argparse
import json
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))


def out(rep, code):
    sys.stdout.write(json.dumps(rep, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return code


def batch_of(lease, now, rep, lat):
    """The producer's batch number from the lease's metadata (PROTOCOL.md
    4.2), its latency noted in lat; None, counted as a verify error, when
    the offer has none."""
    m = lease.meta if isinstance(lease.meta, dict) else {}
    batch, sent = m.get("batch"), m.get("t")
    if not isinstance(batch, int):
        rep["verify_errors"] += 1
        return None
    if isinstance(sent, int):
        lat.append(now - sent)
    return batch


def finish(rep, n, ok, t0, t1, lat):
    """Completes rep from the run (n batches, ok: the data check passed;
    t0, t1: the first and last batch's CLOCK_MONOTONIC ns; lat: one-way
    latencies in ns), prints it, and returns the exit code. bench/py_interop.py
    ends the same way."""
    if n:
        rep["verified" if ok else "verify_errors"] += n
    if t0 is not None and t1 is not None and t1 > t0 and n > 1:
        rep["seconds"] = round((t1 - t0) / 1e9, 3)
        rep["handoffs_per_s"] = round(n / ((t1 - t0) / 1e9), 1)
    if lat:
        lat.sort()
        rep["p50_us"] = round(lat[len(lat) // 2] / 1e3, 1)
        rep["p99_us"] = round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e3, 1)
        rep["max_us"] = round(lat[-1] / 1e3, 1)
    if not ok and not rep.get("error"):
        rep.update(error="wrong data: " + rep["check"], exit=1)
    if n == 0 and not rep.get("error"):
        rep.update(error="no batch received", exit=1)
    return out(rep, rep["exit"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--credits", type=int, default=8)
    ap.add_argument("--work", choices=["sum", "full"], default="sum")
    ap.add_argument("--bytes", type=int, default=16, help="--work sum: bytes of each batch summed")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the producer's socket")
    ap.add_argument("--batches", type=int, default=0, help="stop after this many (0: until the producer ends)")
    ap.add_argument("--view", choices=["array", "dlpack"], default="array",
                    help="how each lease becomes a tensor (see above)")
    ap.add_argument("--shm", choices=["true", "false"], default=None,
                    help="the messages through the shm channel (PROTOCOL.md 2.3) if the producer allows "
                         "them (default: only with CUDASHARE_SHM=1)")
    a = ap.parse_args()
    rep = {"role": "consumer", "impl": "cudashare-python+torch", "device": a.device, "credits": a.credits,
           "workers": 1, "verify": "torch-" + a.work, "view": a.view, "handoffs": 0, "seconds": 0.0, "handoffs_per_s": 0.0,
           "verified": 0, "verify_errors": 0, "errors": 0, "mappings": 0, "exit": 0}
    try:
        import torch
    except ImportError as e:
        rep["skipped"] = "no torch here (%s)" % e
        return out(rep, 3)
    try:
        import cudashare
    except ImportError as e:
        rep["skipped"] = "the cudashare package does not import (%s): is msgpack installed?" % e
        return out(rep, 3)
    if not torch.cuda.is_available():
        rep["skipped"] = "torch sees no GPU"
        return out(rep, 3)
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)
    sp = stream.cuda_stream  # the CUstream as int: __dlpack__ and release take it without a lookup
    K = max(1, a.bytes)
    # --work sum: acc[i] sums byte i of every batch (one in-place add per
    # batch, uint8 into int64, no temporary); --work full: acc[0] counts
    # wrong bytes.
    acc = torch.zeros((K,) if a.work == "sum" else (1,), dtype=torch.int64, device=dev)
    torch.cuda.synchronize(dev)  # acc is zero before stream (maybe non-blocking) adds to it
    from_dlpack = torch.from_dlpack
    u8 = torch.uint8
    work_sum = a.work == "sum"
    want_sum = 0
    use_array = a.view == "array"
    not_in_place = 0
    tensors = set()  # --view array: the distinct tensors it made (one per ring buffer)
    lat = []
    n = 0
    t0 = t1 = None
    try:
        c = cudashare.connect(a.socket, device=a.device, credits=a.credits, backend="cuda", wait=a.wait,
                              handle_sigterm=True, shm=None if a.shm is None else a.shm == "true")
    except (FileNotFoundError, ConnectionRefusedError) as e:
        rep.update(error="no producer at %s: %s" % (a.socket, e), exit=4)
        return out(rep, 4)
    except cudashare.NotSupported as e:
        # torch saw a GPU: cudashare's own CUDA backend failing there is a
        # failure, not a skip.
        rep.update(error="the Python consumer's CUDA backend: %s" % e, exit=1)
        return out(rep, 1)
    rep["driver"] = c.backend
    rep["shm"] = c.stats()["shm"]
    end = "producer said goodbye"
    try:
        with torch.cuda.stream(stream):
            for lease in c:
                now = time.monotonic_ns()
                if t0 is None:
                    t0 = now
                batch = batch_of(lease, now, rep, lat)
                if batch is None:
                    lease.release()
                    continue
                # DLPack, the stream named: sp waits on the producer's event.
                # (Not torch.as_tensor via __cuda_array_interface__: that
                # orders only the legacy default stream, and stream is a
                # non-blocking one.)
                if use_array:
                    x = lease.array(from_dlpack, sp)  # made once per buffer; sp waits on the producer's event
                    if len(tensors) < 1024:
                        tensors.add(id(x))
                else:
                    x = from_dlpack(lease.__dlpack__(stream=sp))  # no copy; sp waits on the producer's event
                if x.dtype != u8 or x.dim() != 1:
                    if x.dtype != u8:
                        x = x.view(u8) if x.is_contiguous() else x
                    x = x.reshape(-1)
                want = batch % 251 + 1
                if work_sum:
                    k = x.numel()
                    if k >= K:
                        acc.add_(x.narrow(0, 0, K))
                        k = K
                    else:
                        acc.narrow(0, 0, k).add_(x)
                    want_sum += k * want
                else:
                    acc.add_((x != want).sum())
                    if x.data_ptr() != lease.ptr:  # the tensor is this lease's memory, not a copy, nor another buffer
                        not_in_place += 1
                del x
                lease.release(stream=sp)  # after the op queued on stream: no host wait
                n += 1
                t1 = time.monotonic_ns()
                if a.batches and n >= a.batches:
                    end = "count"
                    break
        stream.synchronize()
    except cudashare.ProducerGone as e:
        end = "producer vanished"
        rep.update(error=str(e), exit=5)
    except cudashare.CudashareError as e:
        end = "error"
        rep.update(error="%s: %s" % (type(e).__name__, e), exit=1)
    finally:
        st = c.stats()
        c.close()
    got = int(acc.sum().item())
    rep["end"] = end
    rep["handoffs"] = n
    rep["mappings"] = st.get("mappings", 0)
    rep["ordered_releases"] = st.get("ordered_releases")
    # This loop releases every lease: one the consumer gave back as lost
    # (Releases._reap_orphans) would be its mistake, and a race.
    rep["leaked"] = st.get("leaked", 0)
    if use_array:
        rep["tensors"] = len(tensors)
    if rep["leaked"]:
        rep.update(error="%d leases given back as lost, which this loop released itself" % rep["leaked"], exit=1)
    if a.work == "sum":
        ok = got == want_sum
        rep["check"] = "sum of the first %d bytes of every batch: %d, want %d" % (K, got, want_sum)
    else:
        ok = got == 0 and not_in_place == 0
        rep["check"] = "every byte of every batch: %d wrong; tensors not at the lease's address: %d" % (got, not_in_place)
    return finish(rep, n, ok, t0, t1, lat)


if __name__ == "__main__":
    sys.exit(main())
