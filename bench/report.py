#!/usr/bin/env python3
"""Helpers of bench/gpu-bench.sh (standard library only).

  report.py row LABEL PRODUCER_JSON CONSUMER_JSON PRODUCER_EXIT CONSUMER_EXIT [KEY=VALUE...]
      prints one bench.jsonl line for a cudashare row: the consumer's report
      (handoffs/s, latency, verification) with the producer's, or an "error";
      KEY=VALUE pairs (mode, size, ring, device, consumer_device, verify,
      workers) describe the row when a report is missing.
  report.py torch LABEL TORCH_OUTPUT EXIT
      prints one line for a torch.multiprocessing row, or a "skipped"/"error".
  report.py table BENCH_JSONL
      prints the markdown table: rates, latency, the ratio to torch for the
      same mode and devices, the read test, and the targets.
"""
import json
import sys

# Targets of the issue: ratios to torch's handoffs/s, and the read test.
TARGETS = {"ring": 100.0, "fresh": 30.0}
READ_TARGET = 1.05


def last_json(path):
    try:
        with open(path) as f:
            lines = [l.strip() for l in f if l.strip().startswith("{")]
    except OSError as e:
        return None, str(e)
    if not lines:
        return None, "no JSON line in %s" % path
    try:
        return json.loads(lines[-1]), None
    except ValueError as e:
        return None, "%s: %s" % (path, e)


def row(label, pjson, cjson, pexit, cexit, *meta):
    out = {"row": label, "impl": "cudashare"}
    for kv in meta:
        k, _, v = kv.partition("=")
        out[k] = int(v) if v.isdigit() else v
    p, perr = last_json(pjson)
    c, cerr = last_json(cjson)
    if c:
        for k in ("driver", "verify", "workers", "credits", "handoffs", "seconds", "handoffs_per_s",
                  "p50_us", "p99_us", "max_us", "verify_errors", "errors", "verified", "mappings", "read_test", "size"):
            if k in c:
                out[k] = c[k]
        out["consumer_device"] = c.get("device")
        out["same_device"] = c.get("same_device")
    if p:
        for k in ("mode", "ring", "size", "device", "event", "fill"):
            out[k] = p.get(k)
        out["producer_batches_per_s"] = p.get("batches_per_s")
        out["allocations_left"] = p.get("allocations_left")
    errs = []
    if perr or pexit != "0":
        errs.append("producer exit %s: %s" % (pexit, (p or {}).get("error") or perr or ""))
    if cerr or cexit != "0":
        errs.append("consumer exit %s: %s" % (cexit, (c or {}).get("error") or cerr or ""))
    if errs:
        out["error"] = "; ".join(errs)
    print(json.dumps(out))


def torch_row(label, path, exitcode):
    t, err = last_json(path)
    out = {"row": label, "impl": "torch.multiprocessing"}
    if t:
        out.update(t)
    if not t or (exitcode not in ("0", "3") and "error" not in out):
        out["error"] = "exit %s: %s" % (exitcode, err or "see the log")
    print(json.dumps(out))


def fmt(v, nd=0):
    if v is None:
        return "-"
    if isinstance(v, (int, float)):
        return "{:,.{}f}".format(v, nd)
    return str(v)


def devices(r):
    d, c = r.get("device"), r.get("consumer_device")
    if d is None:
        return "-"
    return "GPU %s" % d if c in (None, d) else "GPU %s -> %s" % (d, c)


def size(n):
    if not n:
        return "-"
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d %s" % (n >> shift, unit)
    return "%d B" % n


def table(path):
    rows = []
    with open(path) as f:
        for l in f:
            if l.strip():
                rows.append(json.loads(l))
    torch = {}
    for r in rows:
        if r.get("impl") == "torch.multiprocessing" and r.get("handoffs_per_s"):
            torch[(r.get("mode"), r.get("device"), r.get("consumer_device"))] = r["handoffs_per_s"]
    print("| impl | mode | buffers | devices | verify | handoffs/s | p50 µs | p99 µs | x torch | target |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    notes = []
    for r in rows:
        if "read_test" in r or r.get("row", "").startswith("read"):
            continue
        mode = r.get("mode") or "-"
        bufs = "-"
        if r.get("size"):
            bufs = ("ring of %s x %s" % (r.get("ring"), size(r["size"]))) if mode == "ring" else ("fresh %s" % size(r["size"]))
        verify = r.get("verify", "-")
        if r.get("impl") == "cudashare" and r.get("workers"):
            verify = "%s, %s workers" % (verify, r["workers"])
        if r.get("impl") == "torch.multiprocessing":
            verify = "byte (.item())"
        if r.get("fill") is False:
            verify += "; no fill, no event: the handoff alone"
        if r.get("skipped") or r.get("error"):
            why = r.get("skipped") or r.get("error")
            print("| %s | %s | %s | %s | %s | %s | | | | |" % (r.get("impl"), mode, bufs, devices(r), verify,
                                                              "skipped" if r.get("skipped") else "FAILED"))
            notes.append("%s: %s" % (r.get("row"), why))
            continue
        ratio, target = "-", ""
        t = torch.get((mode, r.get("device"), r.get("consumer_device")))
        if r.get("impl") == "cudashare" and t:
            x = r["handoffs_per_s"] / t
            ratio = "%.0fx" % x if x >= 10 else "%.1fx" % x
            want = TARGETS.get(mode)
            if want:
                target = "%s (>= %.0fx)" % ("met" if x >= want else "MISSED", want)
        if r.get("impl") == "cudashare" and r.get("fill") is False:
            target = "%s (>= 300,000/s)" % ("met" if r["handoffs_per_s"] >= 300000 else "MISSED")
        print("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r.get("impl"), mode, bufs, devices(r), verify, fmt(r.get("handoffs_per_s")),
            fmt(r.get("p50_us"), 1), fmt(r.get("p99_us"), 1), ratio, target))
    for r in rows:
        if "read_test" not in r and not r.get("row", "").startswith("read"):
            continue
        rt = r.get("read_test")
        print()
        if not rt:
            print("read test: FAILED (%s)" % r.get("error"))
            continue
        ok = "met" if rt["ratio"] <= READ_TARGET else "MISSED"
        print("| read a whole buffer (%s, GPU %s) | local ms | shared ms | shared / local | target |" % (size(rt["size"]), r.get("consumer_device")))
        print("| --- | ---: | ---: | ---: | --- |")
        print("| device-to-device copy of the whole buffer, median of %d samples of %d | %.3f | %.3f | %.3f | %s (<= %.2f) |" % (
            rt["reps"], rt.get("copies_per_rep", 1), rt["local_ms"], rt["shared_ms"], rt["ratio"], ok, READ_TARGET))
    if not torch:
        notes.append("no torch row: ratios to torch are not available")
    if notes:
        print()
        for n in notes:
            print("- " + n)


def main(argv):
    if len(argv) >= 6 and argv[0] == "row":
        row(*argv[1:])
    elif len(argv) >= 4 and argv[0] == "torch":
        torch_row(*argv[1:4])
    elif len(argv) >= 2 and argv[0] == "table":
        table(argv[1])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
