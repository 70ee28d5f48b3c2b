"""A real training loop fed four ways, to compare the Go loader
(examples/loader: nvJPEG in another process, batches lent in place through
cudashare) with what trainers use today. ResNet-50 (torchvision,
weights=None), channels-last, bf16 autocast, SGD; the batches are
normalised on the GPU; one step in flight (the host queues step n+1 while
the GPU runs step n, as a real loop does).

    python3 examples/python/train.py --source cudashare  --data DIR --socket SOCK
    python3 examples/python/train.py --source dataloader --data DIR --workers 8
    python3 examples/python/train.py --source gpudecode  --data DIR
    python3 examples/python/train.py --source synthetic  --data DIR

--source cudashare: batches from the loader's ring, each lease a uint8
  NCHW tensor without a copy (lease.array(torch.from_dlpack, stream)),
  released stream-ordered as soon as the step's read of it is queued.
--source dataloader: torch.utils.data.DataLoader over the same tar shards,
  PIL decode, the same random 224 crop, --workers processes,
  pin_memory=True, non_blocking copies.
--source gpudecode: torchvision.io.decode_jpeg(device="cuda") in this
  process, batched, then the crops.
--source synthetic: one batch already on the GPU: the model's own limit.

Every batch's labels are checked against index.json (by key). The last line
is one JSON object: images/s, mean and median step time, the share of steps
that waited for data (more than --wait-ms in getting the batch), this
process's CPU time and its children's (DataLoader's workers), label errors.
"""

import argparse
import faulthandler
import io
import json
import os
import random
import resource
import signal
import sys
import tarfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

try:
    import torch
    import torch.nn.functional as F
    import torchvision
except ImportError as e:
    print(json.dumps({"role": "trainer", "skipped": "no torch or torchvision here: %s" % e}))
    sys.exit(3)


def cpu_times():
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def shard_samples(data, names, rng):
    """(key, label, jpeg bytes) of the shards, each shard's samples
    shuffled, as the loader reads them."""
    for name in names:
        with tarfile.open(os.path.join(data, name)) as tf:
            byk = {}
            for m in tf:
                if not m.isfile():
                    continue
                stem, ext = m.name.split(".", 1)
                b = tf.extractfile(m).read()
                e = byk.setdefault(int(stem), [None, None])
                if ext == "jpg":
                    e[0] = b
                elif ext == "cls":
                    e[1] = int(b)
        keys = list(byk)
        rng.shuffle(keys)
        for k in keys:
            yield k, byk[k][1], byk[k][0]


class Shards(torch.utils.data.IterableDataset):
    """The tar shards, endlessly, for DataLoader: each worker reads its own
    shards (every num_workers-th), decodes with PIL and crops at random."""

    def __init__(self, data, index, crop, seed):
        self.data, self.shards, self.crop, self.seed = data, index["shards"], crop, seed

    def __iter__(self):
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor
        wi = torch.utils.data.get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        mine = self.shards[wid::nw] or self.shards
        epoch = 0
        while True:
            rng = random.Random(self.seed * 1000003 + wid * 7919 + epoch)
            names = list(mine)
            rng.shuffle(names)
            for key, label, jpg in shard_samples(self.data, names, rng):
                img = Image.open(io.BytesIO(jpg)).convert("RGB")
                w, h = img.size
                x, y = rng.randint(0, w - self.crop), rng.randint(0, h - self.crop)
                img = img.crop((x, y, x + self.crop, y + self.crop))
                yield pil_to_tensor(img), label, key
            epoch += 1


def main():
    # A trainer that hangs says where: SIGUSR1 (bench/pipeline.sh sends it at
    # the trainer's limit) prints every thread's stack to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, choices=["cudashare", "dataloader", "gpudecode", "synthetic"])
    ap.add_argument("--data", required=True, help="the data set's directory (examples/datagen -out)")
    ap.add_argument("--socket", default="/tmp/cudashare-%d/loader.sock" % os.getuid())
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--batch", type=int, default=256, help="images per step (cudashare: the loader's -batch)")
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--warmup", type=int, default=10, help="steps before the measurement (cuDNN autotuning, the loader's start)")
    ap.add_argument("--steps", type=int, default=0, help="measured steps (0: --seconds decides)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measure for this long (with --steps 0)")
    ap.add_argument("--workers", type=int, default=8, help="dataloader: worker processes")
    ap.add_argument("--prefetch", type=int, default=2, help="dataloader: batches each worker prepares ahead")
    ap.add_argument("--credits", type=int, default=4, help="cudashare: leases held at once (the loader's lead)")
    ap.add_argument("--wait-ms", type=float, default=1.0, help="a step whose batch took longer than this to get waited for data")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1)
    a = ap.parse_args()

    if not torch.cuda.is_available():
        print(json.dumps({"role": "trainer", "source": a.source, "skipped": "torch sees no GPU"}))
        return 3
    with open(os.path.join(a.data, "index.json")) as f:
        index = json.load(f)
    labels_of = index["labels"]
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(a.seed)
    model = torchvision.models.resnet50(weights=None, num_classes=index["classes"]).to(dev)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=1e-4)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255
    stream = torch.cuda.current_stream(dev)

    def normalise(x):
        return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)

    def train_step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    label_errors = [0]
    checked = [0]

    def check(labels, keys):
        for l, k in zip(labels, keys):
            if labels_of[k] != l:
                label_errors[0] += 1
        checked[0] += len(keys)

    def labels_to_gpu(labels):
        return torch.tensor(labels, dtype=torch.int64).pin_memory().to(dev, non_blocking=True)

    closers = []
    info = {}
    # get() returns (normalised input, labels on the GPU, release-or-None).
    if a.source == "cudashare":
        import cudashare
        c = cudashare.connect(a.socket, device=a.device, credits=a.credits, backend="cuda", wait=120,
                              handle_sigterm=True)
        closers.append(c.close)
        it = iter(c)

        def get():
            lease = next(it)
            m = lease.meta
            check(m["labels"], m["keys"])
            x = lease.array(torch.from_dlpack, stream)   # uint8 NCHW, the loader's buffer, no copy
            return x, labels_to_gpu(m["labels"]), lease
        info["sharing"] = "see the loader"
    elif a.source == "dataloader":
        dl = torch.utils.data.DataLoader(Shards(a.data, index, a.crop, a.seed), batch_size=a.batch,
                                         num_workers=a.workers, pin_memory=True, persistent_workers=True,
                                         prefetch_factor=a.prefetch)
        it = iter(dl)

        def close_dl():
            nonlocal it
            it._shutdown_workers()  # joins the workers, so RUSAGE_CHILDREN counts them
            it = None
        closers.append(close_dl)

        def get():
            x, y, keys = next(it)
            check(y.tolist(), keys.tolist())
            return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), None
        info["workers"] = a.workers
    elif a.source == "gpudecode":
        from torchvision.io import decode_jpeg

        def samples():
            epoch = 0
            while True:
                rng = random.Random(a.seed * 1000003 + epoch)
                names = list(index["shards"])
                rng.shuffle(names)
                for s in shard_samples(a.data, names, rng):
                    yield s
                epoch += 1
        src = samples()
        rng = random.Random(a.seed)

        def get():
            keys, labels, datas = [], [], []
            for _ in range(a.batch):
                k, l, jpg = next(src)
                keys.append(k)
                labels.append(l)
                datas.append(torch.frombuffer(bytearray(jpg), dtype=torch.uint8))
            check(labels, keys)
            imgs = decode_jpeg(datas, device=dev)
            crops = []
            for im in imgs:
                h, w = im.shape[-2:]
                y, x = rng.randint(0, h - a.crop), rng.randint(0, w - a.crop)
                crops.append(im[:, y:y + a.crop, x:x + a.crop])
            return torch.stack(crops), labels_to_gpu(labels), None
    else:
        xs = torch.randint(0, 256, (a.batch, 3, a.crop, a.crop), dtype=torch.uint8, device=dev)
        ys = torch.randint(0, index["classes"], (a.batch,), device=dev)

        def get():
            return xs, ys, None

    prev = None   # the event after the previous step: one step in flight
    waits, steps_t = [], []
    n = images = 0
    loss = None
    cpu0 = cpu_times()
    t_start = None
    try:
        while True:
            measuring = n >= a.warmup
            if measuring and t_start is None:
                torch.cuda.synchronize(dev)
                t_start = time.perf_counter()
                cpu0 = cpu_times()
            t0 = time.perf_counter()
            try:
                x, y, lease = get()
            except (StopIteration, Exception) as e:  # the loader ended, or failed
                if type(e).__name__ in ("Closed", "ProducerGone", "StopIteration"):
                    info["end"] = "source ended: %s" % type(e).__name__
                    break
                raise
            t1 = time.perf_counter()
            if x.shape[0] != a.batch:
                raise SystemExit("batch of %d, --batch %d" % (x.shape[0], a.batch))
            xn = normalise(x)
            if lease is not None:
                lease.release(stream=stream)   # the step's read of the batch is queued: no host wait
            loss = train_step(xn, y)
            ev = torch.cuda.Event()
            ev.record(stream)
            if prev is not None:
                prev.synchronize()
            prev = ev
            t2 = time.perf_counter()
            if measuring:
                waits.append(t1 - t0)
                steps_t.append(t2 - t0)
                images += a.batch
            n += 1
            if measuring and ((a.steps and len(steps_t) >= a.steps) or
                              (not a.steps and time.perf_counter() - t_start >= a.seconds)):
                break
        torch.cuda.synchronize(dev)
        t_end = time.perf_counter()
        last_loss = float(loss.item()) if loss is not None else None
    finally:
        for f in closers:
            f()
    cpu1 = cpu_times()
    secs = (t_end - t_start) if t_start else 0.0
    ms = sorted(s * 1000 for s in steps_t)
    thr = a.wait_ms / 1000
    rep = {
        "role": "trainer", "source": a.source, "batch": a.batch, "warmup": a.warmup, "steps": len(steps_t),
        "images": images, "seconds": round(secs, 3), "images_per_s": round(images / secs, 1) if secs else 0,
        "step_ms_mean": round(sum(ms) / len(ms), 2) if ms else None,
        "step_ms_p50": round(ms[len(ms) // 2], 2) if ms else None,
        "waited_share": round(sum(1 for w in waits if w > thr) / len(waits), 4) if waits else None,
        "wait_ms_mean": round(1000 * sum(waits) / len(waits), 3) if waits else None,
        "cpu_s": round(cpu1[0], 3), "cpu_window_s": round(cpu1[0] - cpu0[0], 3),
        "cpu_children_s": round(cpu1[1], 3),
        "labels_checked": checked[0], "label_errors": label_errors[0], "loss_last": last_loss,
        "torch": torch.__version__, "torchvision": torchvision.__version__, "gpu": torch.cuda.get_device_name(dev),
    }
    rep.update(info)
    print(json.dumps(rep))
    return 1 if label_errors[0] else 0


if __name__ == "__main__":
    sys.exit(main())
