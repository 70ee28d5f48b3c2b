#!/usr/bin/env python3
"""Helpers of bench/gpu-bench.sh (standard library only).

  report.py row LABEL PRODUCER_JSON CONSUMER_JSON PRODUCER_EXIT CONSUMER_EXIT [KEY=VALUE...]
      prints one bench.jsonl line for a cudashare row: the consumer's report
      (handoffs/s, latency, verification) with the producer's, or an "error";
      KEY=VALUE pairs (device, consumer_device, verify, workers, credits,
      in_flight, gpu_work) describe the row.
  report.py tool LABEL JSON_OUTPUT EXIT [KEY=VALUE...]
      prints one line for a row of a tool that prints its own JSON line
      (bench/floor, bench/limit, bench/cupy_ipc.py, bench/torch_mp.py), or a
      "skipped" (exit 3) or an "error"; KEY=VALUE pairs fill in keys the
      tool's line lacks.
  report.py skip LABEL REASON [KEY=VALUE...]
      prints one "skipped" line.
  report.py costs LABEL VMMCOST_JSONL EXIT
      prints bench/vmmcost's lines (the costs of each sharing path) tagged
      with the group LABEL, or one "error" line if there are none.
  report.py table BENCH_JSONL [ENV_TXT]
      prints the markdown table: the command and the machine (from ENV_TXT),
      then each row's handoffs/s, latency, and its ratio to the floor (the
      bare socket with as many messages in flight), to the limit (the same
      GPU work in one process, for rows with GPU work) and to torch (same
      mode, size and GPUs); then the cudashare and Python rows with legacy
      IPC and VMM side by side, the costs of each path, the read test and
      notes.
"""
import json
import sys

# Targets of the hot-path issue, on the two-H200 machine in one run.
RING8_TARGET = 450000        # ring of 8 x 1 MiB, handoff alone, credits 8 (1 worker) ...
RING8_P99_TARGET = 40.0      # ... with p99 under 40 µs
RING64_TARGET = 600000       # ring of 64, credits 64
RTT_TARGET = 1.3             # one in flight: round trip within 1.3x the bare socket's
ORDERED_BASE = 10068         # the rate with one byte read back per batch (2026-11-22) ...
ORDERED_SAME_GPU_TARGET = 5  # ... which stream-ordered release with GPU work beats 5x on one GPU
ORDERED_LIMIT_TARGET = 0.80  # and reaches 80% of the one-process limit across two GPUs
FRESH_TARGET = 0.95          # fresh 64 MiB from an arena at 95% of the ring's rate
READ_TARGET = 1.05
# The Python consumer issue: with torch work per batch, ring of 8 x 1 MiB.
PY_TORCH_TARGET = 20.0
SHARINGS = ("ipc", "vmm")


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


def emit(out):
    """Prints the row's JSON line, and a short line to stderr."""
    print(json.dumps(out))
    if out.get("skipped"):
        short = "skipped: %s" % out["skipped"]
    elif out.get("error"):
        short = "error: %s" % out["error"]
    elif out.get("read_test"):
        short = "read test: shared/local %s" % out["read_test"].get("ratio")
    else:
        short = "%s/s" % fmt(out.get("handoffs_per_s"))
        if out.get("p50_us") is not None:
            short += ", p50 %s µs, p99 %s µs" % (fmt(out.get("p50_us"), 1), fmt(out.get("p99_us"), 1))
        if out.get("verify_errors"):
            short += ", %s WRONG" % out["verify_errors"]
    sys.stderr.write("   %s\n" % short)


def parse_meta(meta):
    out = {}
    for kv in meta:
        k, _, v = kv.partition("=")
        if v.isdigit():
            v = int(v)
        elif v in ("true", "false"):
            v = v == "true"
        out[k] = v
    return out


def row(label, pjson, cjson, pexit, cexit, *meta):
    out = {"row": label, "impl": "cudashare"}
    out.update(parse_meta(meta))
    p, perr = last_json(pjson)
    c, cerr = last_json(cjson)
    if c:
        for k in ("driver", "verify", "workers", "credits", "handoffs", "seconds", "handoffs_per_s",
                  "p50_us", "p99_us", "max_us", "verify_errors", "errors", "verified", "mappings", "read_test", "size",
                  "async_waits", "shm", "cpu_us_per_handoff"):
            if k in c:
                out[k] = c[k]
        out["consumer_device"] = c.get("device")
        out["same_device"] = c.get("same_device")
    if p:
        asked = out.get("sharing")
        for k in ("mode", "ring", "size", "device", "event", "fill", "sharing", "group"):
            out[k] = p.get(k)
        if asked and p.get("sharing") and p["sharing"] != asked:
            out["error"] = "asked for -sharing %s, the producer took %s: %s" % (asked, p["sharing"], p.get("sharing_why"))
        out["producer_batches_per_s"] = p.get("batches_per_s")
        out["producer_cpu_us_per_batch"] = p.get("cpu_us_per_batch")
        out["allocations_left"] = p.get("allocations_left")
    errs = []
    if perr or pexit != "0":
        errs.append("producer exit %s: %s" % (pexit, (p or {}).get("error") or perr or ""))
    if cerr or cexit != "0":
        errs.append("consumer exit %s: %s" % (cexit, (c or {}).get("error") or cerr or ""))
    if errs:
        out["error"] = "; ".join(errs + ([out["error"]] if out.get("error") else []))
    emit(out)


def tool(label, path, exitcode, *meta):
    t, err = last_json(path)
    out = {"row": label}
    if t:
        out.update(t)
    for k, v in parse_meta(meta).items():
        out.setdefault(k, v)
    out.setdefault("impl", label.split("-")[0])
    if exitcode == "3" and "skipped" not in out:
        out["skipped"] = "exit 3: %s" % (err or "see the log")
    if not t or (exitcode not in ("0", "3") and "error" not in out):
        out["error"] = "exit %s: %s" % (exitcode, out.get("error") or err or "see the log")
    emit(out)


def costs(label, path, exitcode):
    n = 0
    try:
        with open(path) as f:
            for l in f:
                l = l.strip()
                if not l.startswith("{"):
                    continue
                try:
                    r = json.loads(l)
                except ValueError:
                    continue
                r["group"] = label
                r["row"] = "%s-%s" % (label, r.get("row", "?"))
                r.setdefault("impl", "vmmcost")
                print(json.dumps(r))
                n += 1
                if r.get("error"):
                    sys.stderr.write("   %s: error: %s\n" % (r["row"], r["error"]))
    except OSError as e:
        sys.stderr.write("   %s\n" % e)
    if n == 0:
        print(json.dumps({"row": label, "impl": "vmmcost", "group": label,
                          "error": "exit %s: no JSON line (see %s.log)" % (exitcode, label)}))
        sys.stderr.write("   error: exit %s, no output\n" % exitcode)
    else:
        sys.stderr.write("   %d cost lines, exit %s\n" % (n, exitcode))


def skip(label, why, *meta):
    out = {"row": label, "impl": "-", "skipped": why}
    out.update(parse_meta(meta))
    emit(out)


def fmt(v, nd=0):
    if v is None:
        return "-"
    if isinstance(v, (int, float)):
        return "{:,.{}f}".format(v, nd)
    return str(v)


def size(n):
    if not n:
        return "-"
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return "%d %s" % (n >> shift, unit)
    return "%d B" % n


def gpus(r):
    d, c = r.get("device"), r.get("consumer_device")
    if d is None:
        return "-"
    return "%s" % d if c in (None, d) else "%s -> %s" % (d, c)


def ratio(x):
    if x is None:
        return "-"
    if x >= 10:
        return "%.0fx" % x
    if x >= 1:
        return "%.1fx" % x
    return "%.2f" % x


def bufs(r):
    if r.get("impl") == "floor":
        return "-"
    if not r.get("size"):
        return "-"
    if r.get("mode") == "fresh":
        return "fresh %s" % size(r["size"]) + (" (arena)" if r.get("impl") == "cudashare" else "")
    return "ring of %s x %s" % (r.get("ring", "?"), size(r["size"]))


def work(r):
    """The GPU work per batch of row r, and whether it ran under MPS."""
    return what_work(r) + (", under MPS" if r.get("mps") else "")


def what_work(r):
    impl = r.get("impl")
    if impl == "floor":
        return "%s B out, %s B back" % (r.get("msg_bytes", 96), r.get("ack_bytes", 16))
    if impl == "limit":
        return "fill; C waits" if r.get("gpu_work") == "fill" else "fill; C waits, copies"
    if impl == "cudashare":
        if r.get("gpu_work") == "none" or r.get("fill") is False:
            w = "none: the handoff alone"
        else:
            w = "fill + event, verify %s" % r.get("verify", "?")
        if r.get("workers"):
            w += ", %s worker%s" % (r["workers"], "" if r["workers"] == 1 else "s")
        if (r.get("group") or 1) > 1:
            w += ", groups of %s" % r["group"]
        if r.get("shm") is False:
            w += ", messages on the socket (-shm=false)"
        return w
    if impl == "cupy":
        if r.get("gpu_work") == "none":
            return "none: the handoff alone"
        return "fill + %s, readback %s" % ("event" if r.get("sync", "event") == "event" else "host sync", r.get("verify", "?"))
    if impl == "torch.multiprocessing":
        return "fill + host sync, .item()"
    shm = ", messages through the shm channel (--shm true)" if r.get("shm") is True else ""
    if impl == "cudashare-python":
        return "none: the handoff alone (python -m cudashare consume)" + shm
    if impl == "cudashare-python+torch":
        return "fill + event; torch sum of 16 B, stream-ordered release" + shm
    return r.get("gpu_work") or "-"


def cpu(r):
    """The CPU time per batch of the producer and per handoff of the
    consumer (each process, user and system, every thread), where the row's
    programs report it."""
    p, c = r.get("producer_cpu_us_per_batch"), r.get("cpu_us_per_handoff")
    if not p and not c:
        return "-"
    return "%s / %s" % (fmt(p, 1) if p else "-", fmt(c, 1) if c else "-")


def in_flight(r):
    if r.get("impl") == "floor":
        return r.get("window")
    if r.get("in_flight"):
        return r["in_flight"]
    if r.get("impl") in ("cupy", "torch.multiprocessing"):
        return r.get("ring")
    return None


def table(path, env=None):
    rows = []
    with open(path) as f:
        for l in f:
            if l.strip():
                rows.append(json.loads(l))
    if env:
        try:
            with open(env) as f:
                lines = [l.rstrip("\n") for l in f]
            head = lines[:2] + [l for l in lines[2:] if l.startswith(("host:", "topology:"))]
            for l in head:
                print(l.lstrip("= "))
                print()
        except OSError:
            pass

    def ok(r):
        return r.get("handoffs_per_s") and not r.get("error") and not r.get("skipped")

    floor = {r.get("window"): r["handoffs_per_s"] for r in rows if r.get("impl") == "floor" and ok(r)}
    # Rows under MPS are judged against the limit and torch under MPS.
    limit = {limit_key(r): r for r in rows if r.get("impl") == "limit" and ok(r)}
    torch = {torch_key(r): r["handoffs_per_s"] for r in rows if r.get("impl") == "torch.multiprocessing" and ok(r)}

    print("| row | impl | buffers | GPUs | GPU work per batch | in flight | handoffs/s | p50 µs | p99 µs | CPU µs P / C "
          "| x floor | x limit | x torch |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    notes, targets, drains = [], [], []
    costs_rows = [r for r in rows if r.get("impl") == "vmmcost"]
    rows = [r for r in rows if r.get("impl") != "vmmcost"]
    for r in rows:
        if "read_test" in r or r.get("row", "").startswith("read"):
            continue
        impl = r.get("impl", "-")
        cells = [r.get("row", "-"), impl, bufs(r), gpus(r), work(r), fmt(in_flight(r))]
        if r.get("skipped") or r.get("error"):
            why = r.get("skipped") or r.get("error")
            cells += ["skipped" if r.get("skipped") else "FAILED", "", "", "", "", "", ""]
            print("| " + " | ".join(cells) + " |")
            notes.append("%s: %s: %s" % (r.get("row"), "skipped" if r.get("skipped") else "FAILED", why))
            continue
        rate = r.get("handoffs_per_s")
        xf = xl = xt = "-"
        if impl == "floor":
            xf = "floor"
        elif impl == "limit":
            xl = "limit"
            if r.get("drain_ms") is not None and r.get("driver") != "sim":
                drains.append("%s %.3f" % (r["row"], r["drain_ms"]))
        else:
            fl = floor.get(in_flight(r))
            if fl and rate:
                xf = ratio(rate / fl)
            lm = limit.get(limit_key(r))
            if lm and rate and r.get("gpu_work") in ("fill", "fill+copy"):
                xl = ratio(rate / lm["handoffs_per_s"])
        if impl not in ("floor", "torch.multiprocessing"):
            t = torch.get(torch_key(r))
            if t and rate:
                xt = ratio(rate / t)
                if impl == "cudashare-python+torch" and r.get("mode") == "ring":
                    targets.append("%s: %s torch%s (target >= %.0fx): %s" % (r["row"], xt, under_mps(r), PY_TORCH_TARGET,
                                                                            met(rate / t >= PY_TORCH_TARGET)))
        if impl == "cudashare":
            targets += hot_path_targets(r, rate, floor, limit, rows, ok)
        cells += [fmt(rate), fmt(r.get("p50_us"), 1), fmt(r.get("p99_us"), 1), cpu(r), xf, xl, xt]
        print("| " + " | ".join(cells) + " |")
    sharing_table(rows, torch, ok)
    cost_table(costs_rows)
    for r in rows:
        if "read_test" not in r and not r.get("row", "").startswith("read"):
            continue
        rt = r.get("read_test")
        print()
        if not rt:
            print("read test: FAILED (%s)" % r.get("error"))
            continue
        okr = "met" if rt["ratio"] <= READ_TARGET else "MISSED"
        print("| read a whole buffer (%s, GPU %s) | local ms | shared ms | shared / local | target |" % (size(rt["size"]), r.get("consumer_device")))
        print("| --- | ---: | ---: | ---: | --- |")
        print("| device-to-device copy of the whole buffer, median of %d samples of %d | %.3f | %.3f | %.3f | %s (<= %.2f) |" % (
            rt["reps"], rt.get("copies_per_rep", 1), rt["local_ms"], rt["shared_ms"], rt["ratio"], okr, READ_TARGET))
    print()
    print("- x floor: handoffs/s over the bare socket's messages/s with as many in flight (one in flight: round trips/s); "
          "x limit: over the same GPU work in one process with no IPC (fill: stream C only waits; fill + copy: it copies "
          "the buffer), same buffer size and GPUs; x torch: over torch.multiprocessing, same mode, size and GPUs.")
    print("- CPU µs P / C: the CPU time (user and system, every thread) of the producer process per batch and of the "
          "consumer process per handoff, where the row's programs report it: what a handoff costs the CPUs a "
          "trainer shares, including the polling of the shm channel.")
    print("- p50/p99: floor rows, the round trip; the others, one way, from the offer (send, put) to the consumer's "
          "receipt on the host's CLOCK_MONOTONIC.")
    if not floor:
        notes.append("no floor row: ratios to the floor are not available")
    if not limit:
        notes.append("no limit row: ratios to the limit are not available")
    if not torch:
        notes.append("no torch row: ratios to torch are not available")
    if drains:
        print("- limit rows, ms the GPU took to finish after the host queued the last batch (a full queue, a "
              "millisecond or more: the GPU was the bound; a few µs: the host's driver calls were): " + ", ".join(drains))
    for n in targets:
        print("- target: " + n)
    for n in notes:
        print("- " + n)


def limit_key(r):
    """The limit row a row is judged against: same GPU work, buffer size,
    GPUs, and MPS or not."""
    return (r.get("gpu_work"), r.get("size"), r.get("device"), r.get("consumer_device"), bool(r.get("mps")))


def torch_key(r):
    """The torch.multiprocessing row a row is compared with: same mode,
    size, GPUs, and MPS or not."""
    return (r.get("mode"), r.get("size"), r.get("device"), r.get("consumer_device"), bool(r.get("mps")))


def under_mps(r):
    return " under MPS" if r.get("mps") else ""


def met(good):
    return "met" if good else "MISSED"


def hot_path_targets(r, rate, floor, limit, rows, ok):
    """The hot-path issue's targets that row r answers, one line each."""
    out = []
    label, w, cr = r.get("row", ""), r.get("workers"), r.get("credits")
    if r.get("shm") is False:
        return out  # a row for comparison: the messages on the socket
    if r.get("gpu_work") == "none" and r.get("mode") == "ring":
        if r.get("ring") == 8 and cr == 8 and w == 1:
            p99 = r.get("p99_us") or 0
            out.append("%s: %s/s, p99 %s µs (target >= %s/s, p99 < %.0f µs): %s" % (
                label, fmt(rate), fmt(p99, 1), fmt(RING8_TARGET), RING8_P99_TARGET,
                met(rate >= RING8_TARGET and p99 < RING8_P99_TARGET)))
        elif r.get("ring") == 64 and cr == 64:
            out.append("%s: %s/s (target >= %s/s): %s" % (label, fmt(rate), fmt(RING64_TARGET), met(rate >= RING64_TARGET)))
        elif cr == 1 and floor.get(1):
            x = floor[1] / rate
            out.append("%s: round trip %.3fx the bare socket's (target <= %.1fx): %s" % (label, x, RTT_TARGET, met(x <= RTT_TARGET)))
    if r.get("gpu_work") == "none" and r.get("mode") == "fresh":
        # The ring of 64 with the same credits, GPUs and path.
        base, sh = split_sharing(label)
        twin = base and "%s-%s" % (base.replace("cudashare-fresh-", "cudashare-ring64-", 1), sh)
        ring = [x for x in rows if x.get("row") == twin and ok(x)]
        if ring:
            x = rate / ring[0]["handoffs_per_s"]
            out.append("%s: %.3f of %s (target >= %.2f): %s" % (label, x, twin, FRESH_TARGET, met(x >= FRESH_TARGET)))
    if r.get("verify") == "async" and r.get("mode") == "ring":
        if r.get("device") == r.get("consumer_device"):
            x = rate / ORDERED_BASE
            out.append("%s: %.1fx the issue's %s/s%s (target >= %dx on one GPU): %s" % (
                label, x, fmt(ORDERED_BASE), under_mps(r), ORDERED_SAME_GPU_TARGET, met(x >= ORDERED_SAME_GPU_TARGET)))
        else:
            lm = limit.get(limit_key(r))
            if lm:
                x = rate / lm["handoffs_per_s"]
                out.append("%s: %.3f of the one-process limit (target >= %.2f across GPUs): %s" % (
                    label, x, ORDERED_LIMIT_TARGET, met(x >= ORDERED_LIMIT_TARGET)))
    return out


def split_sharing(label):
    for sh in SHARINGS:
        if label.endswith("-" + sh):
            return label[:-len(sh) - 1], sh
    return None, None


def sharing_table(rows, torch, ok):
    """The cudashare and Python rows run for both paths, side by side."""
    pairs, order = {}, []
    for r in rows:
        base, sh = split_sharing(r.get("row", ""))
        if not base:
            continue
        if base not in pairs:
            pairs[base] = {}
            order.append(base)
        pairs[base][sh] = r
    if not order:
        return
    print()
    print("Legacy CUDA IPC and VMM (fds) side by side (the rows above, by sharing path):")
    print()
    print("| row | buffers | GPUs | GPU work per batch | in flight | IPC handoffs/s | VMM handoffs/s | VMM / IPC "
          "| IPC p99 µs | VMM p99 µs | IPC x torch | VMM x torch |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for base in order:
        p = pairs[base]
        any_r = p.get("ipc") or p.get("vmm")
        cells = [base, bufs(any_r), gpus(any_r), work(any_r), fmt(in_flight(any_r))]
        rates, p99s, xts = [], [], []
        for sh in SHARINGS:
            r = p.get(sh)
            if r is None:
                rates.append(None); p99s.append("-"); xts.append("-")
                continue
            if not ok(r):
                rates.append(None); p99s.append("skipped" if r.get("skipped") else "FAILED"); xts.append("-")
                continue
            rates.append(r["handoffs_per_s"])
            p99s.append(fmt(r.get("p99_us"), 1))
            t = torch.get(torch_key(r))
            xts.append(ratio(r["handoffs_per_s"] / t) if t else "-")
        rel = ratio(rates[1] / rates[0]) if rates[0] and rates[1] else "-"
        def cell(i):
            if rates[i] is not None:
                return fmt(rates[i])
            return p99s[i] if p99s[i] in ("skipped", "FAILED") else "-"
        cells += [cell(0), cell(1), rel,
                  p99s[0] if rates[0] is not None else "", p99s[1] if rates[1] is not None else "", xts[0], xts[1]]
        print("| " + " | ".join(cells) + " |")


def cost_table(rows):
    """bench/vmmcost's lines: each cost for both paths, then the first offer."""
    if not rows:
        return
    groups = []
    for r in rows:
        if r.get("group") not in groups:
            groups.append(r.get("group"))
    for g in groups:
        rs = [r for r in rows if r.get("group") == g]
        head = [r for r in rs if not r.get("op")]
        print()
        if head:
            print("%s: FAILED: %s" % (g, head[0].get("error") or head[0].get("skipped")))
            continue
        r0 = rs[0]
        print("Costs of sharing one allocation (%s, bench/vmmcost, driver %s, GPU %s; median µs of n, "
              "[min-max], first rep in parentheses):" % (g, r0.get("driver"), gpus(r0)))
        print()
        print("| op | size | legacy IPC | µs | VMM | µs | VMM / IPC |")
        print("| --- | --- | --- | ---: | --- | ---: | ---: |")
        keys, by = [], {}
        for r in rs:
            op = r.get("op", "")
            if op.startswith("first-offer"):
                continue
            k = (op, r.get("size"))
            if k not in by:
                by[k] = {}
                keys.append(k)
            by[k][r.get("path")] = r
        opord = ["alloc", "map", "export", "import", "consumer-map", "open", "close", "free"]
        keys.sort(key=lambda k: (k[1] or 0, opord.index(k[0]) if k[0] in opord else len(opord)))
        for k in keys:
            d = by[k]
            c = [k[0], size(k[1])]
            vals = []
            for sh in SHARINGS:
                r = d.get(sh)
                if r is None:
                    c += ["-", "-"]
                    vals.append(None)
                elif r.get("error"):
                    c += [r.get("what", ""), "FAILED: %s" % r["error"]]
                    vals.append(None)
                else:
                    c += [r.get("what", ""), "%s [%s-%s] (%s), n %d" % (fmt(r["median_us"], 1), fmt(r["min_us"], 1),
                                                                         fmt(r["max_us"], 1), fmt(r["first_us"], 1), r["n"])]
                    vals.append(r["median_us"])
            c.append(ratio(vals[1] / vals[0]) if vals[0] and vals[1] else "-")
            print("| " + " | ".join(c) + " |")
        fo = [r for r in rs if r.get("op", "").startswith("first-offer")]
        if not fo:
            continue
        print()
        print("First offer through cudashare (a fresh consumer process per rep; median µs [min-max]):")
        print()
        print("| buffers | measure | legacy IPC µs | VMM µs | VMM / IPC |")
        print("| --- | --- | ---: | ---: | ---: |")
        keys, by = [], {}
        for r in fo:
            k = r["op"].replace("first-offer-", "")
            if k not in by:
                by[k] = {}
                keys.append(k)
            by[k][r.get("path")] = r
        for k in keys:
            d = by[k]
            any_r = d.get("ipc") or d.get("vmm")
            what = any_r.get("what", "")
            buf, _, meas = what.partition(": ")
            c = [buf, meas]
            vals = []
            for sh in SHARINGS:
                r = d.get(sh)
                if r is None:
                    c.append("-"); vals.append(None)
                elif r.get("error"):
                    c.append("FAILED: %s" % r["error"]); vals.append(None)
                else:
                    c.append("%s [%s-%s]" % (fmt(r["median_us"], 1), fmt(r["min_us"], 1), fmt(r["max_us"], 1)))
                    vals.append(r["median_us"])
            c.append(ratio(vals[1] / vals[0]) if vals[0] and vals[1] else "-")
            print("| " + " | ".join(c) + " |")


def main(argv):
    if len(argv) >= 6 and argv[0] == "row":
        row(*argv[1:])
    elif len(argv) >= 4 and argv[0] in ("tool", "torch"):
        tool(*argv[1:])
    elif len(argv) >= 3 and argv[0] == "skip":
        skip(*argv[1:])
    elif len(argv) == 4 and argv[0] == "costs":
        costs(*argv[1:])
    elif len(argv) in (2, 3) and argv[0] == "table":
        table(*argv[1:])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
