"""A PyTorch loop over the Go example producer's batches, as tensors, with
no copy: checks each batch on the GPU (every byte of batch n is
n % 251 + 1, PROTOCOL.md §4.2), releases it stream-ordered, and prints
handoffs per second.

    go run ./cmd/cudashare producer &          # on a GPU machine
    python examples/python/trainer.py --socket /tmp/cudashare-$(id -u)/cudashare.sock

--batches N stops after N batches (default: until the producer says
goodbye). The last line says how it went: "trainer: ok: N batches, every
byte verified on the GPU" (exit 0), or "trainer: FAILED: ..." (exit 1:
wrong bytes, or no batch at all). Without torch or without a GPU it says
"trainer: skipped: ..." and exits 0.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

try:
    import torch
except ImportError:
    print("trainer: skipped: no torch here (pip install torch)")
    sys.exit(0)

import cudashare


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", default="/tmp/cudashare-%d/cudashare.sock" % os.getuid())
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--credits", type=int, default=8)
    ap.add_argument("--batches", type=int, default=0, help="stop after this many (0: until the producer ends)")
    ap.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the producer's socket")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("trainer: skipped: torch sees no GPU")
        return 0
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        bad = torch.zeros((), dtype=torch.int64, device=dev)  # zeroed on stream, before the checks add to it
    n = 0
    with cudashare.connect(a.socket, device=a.device, credits=a.credits, backend="cuda", wait=a.wait,
                           handle_sigterm=True) as c:
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for lease in c:
                x = lease.array(torch.from_dlpack, stream)  # no copy; made once per ring buffer
                want = lease.meta["batch"] % 251 + 1
                bad += (x != want).sum()              # the check, on the GPU
                lease.release(stream=stream)          # after the work queued so far
                n += 1
                if a.batches and n >= a.batches:
                    break
        stream.synchronize()
        dt = time.perf_counter() - t0
    wrong = int(bad.item())
    print("trainer: %d handoffs in %.2fs: %.0f/s; %d wrong bytes" % (n, dt, n / dt if dt else 0, wrong))
    if n == 0:
        print("trainer: FAILED: no batch received")
        return 1
    if wrong:
        print("trainer: FAILED: %d wrong bytes in %d batches" % (wrong, n))
        return 1
    print("trainer: ok: %d batches, every byte verified on the GPU" % n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
