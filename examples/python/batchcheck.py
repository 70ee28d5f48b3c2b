"""Checks the loader's batches (examples/loader) in plain Python: no torch,
no numpy, only the cudashare consumer and msgpack, so that it runs on the
simulator in CI.

    python3 examples/python/batchcheck.py --socket SOCK --data DIR [--backend sim]

For every batch: dtype uint8 and shape [B, 3, C, C] (PROTOCOL.md 4.2),
B labels, keys and crop offsets in the metadata, and every label the one
index.json gives its key. It cannot decode a JPEG (no Pillow here), so it
prints, per image, the SHA-256 of the C x C x 3 bytes it received with the
key and the crop offset, one JSON line each, for the caller (the Go test
examples/loader TestLoaderFeedsPythonConsumer) to compare with its own
decode of the same JPEG at the same offset. The last line is a summary;
exit 1 if a label or a shape was wrong.
"""

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import cudashare  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--data", required=True, help="the data set's directory (its index.json)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--wait", type=float, default=30.0)
    a = ap.parse_args()
    with open(os.path.join(a.data, "index.json")) as f:
        labels = json.load(f)["labels"]
    bad = []
    batches = images = 0
    with cudashare.connect(a.socket, backend=a.backend, credits=2, wait=a.wait) as c:
        for lease in c:
            with lease:
                m = lease.meta
                dtype, shape = lease.view()
                b, ch, h, w = shape
                if dtype != "uint8" or ch != 3 or h != w or len(m["labels"]) != b or len(m["keys"]) != b \
                        or len(m["crops"]) != 2 * b or m["batch"] != batches:
                    bad.append("batch %d: dtype %s shape %s batch %s, %d labels" % (batches, dtype, shape, m["batch"], len(m["labels"])))
                    continue
                data = lease.host() if c.backend == "sim" else lease.read()
                sz = 3 * h * w
                for i, key in enumerate(m["keys"]):
                    if labels[key] != m["labels"][i]:
                        bad.append("batch %d image %d: key %d has label %d, index.json %d" % (batches, i, key, m["labels"][i], labels[key]))
                    print(json.dumps({"key": key, "epoch": m["epoch"], "x": m["crops"][2 * i], "y": m["crops"][2 * i + 1],
                                      "sha256": hashlib.sha256(bytes(data[i * sz:(i + 1) * sz])).hexdigest()}))
                    images += 1
            batches += 1
    print(json.dumps({"role": "batchcheck", "batches": batches, "images": images, "errors": bad}))
    return 1 if bad or not batches else 0


if __name__ == "__main__":
    sys.exit(main())
