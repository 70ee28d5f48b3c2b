#!/usr/bin/env bash
# bench/python-gpu-check.sh: the Go example producer to the Python consumer
# (python/), legacy CUDA IPC and VMM, verifying every batch. On the GPU
# machine, from the repository root, after scripts/gpu-test:
#
#   bash bench/python-gpu-check.sh [-count N] [-frameworks 'cupy cupy-dlpack jax torch-cai']
#   (device tool: run(command="bash bench/python-gpu-check.sh", carry=[".gpu"]))
#
# Cases, each for -sharing ipc and -sharing vmm, same GPU, then with two GPUs
# the consumer on GPU 1 (skipped with a note on one GPU):
#   torch-ring       bench/py_consumer.py --work full: ring of 8 x 1 MiB, each
#                    lease a torch tensor (lease.array(torch.from_dlpack):
#                    made once per buffer, no copy), every byte compared
#                    with the batch's pattern on the GPU, stream-ordered
#                    release.
#   torch-ring-dlpack  the same with --view dlpack: a DLPack capsule and a
#                    new tensor per lease.
#   torch-fresh      the same with fresh 64 MiB buffers from an arena.
#   cli-ring         python -m cudashare consume --verify full: every byte of
#                    every batch copied back to the host and checked (no torch).
#   cupy-ring        bench/py_interop.py --framework cupy: cupy.asarray(lease)
#                    (__cuda_array_interface__ v3), checked on a non-blocking
#                    CuPy stream ordered after the CAI's stream, stream-ordered
#                    release. CuPy also waits on the host for the CAI's stream
#                    (CAI v3); CUPY_CUDA_ARRAY_INTERFACE_SYNC=0 in the
#                    environment turns that off, leaving the GPU-side order.
#   cupy-dlpack-ring --framework cupy-dlpack: cupy.from_dlpack(lease) and
#                    cupy.from_dlpack(lease.__dlpack__(stream=ptr)), alternating.
#   jax-ring         --framework jax: jax.numpy.from_dlpack(lease), a jitted
#                    check, release from the host once it is done; skipped
#                    with a note where jax (with a GPU backend) is missing.
#   torch-cai-ring   --framework torch-cai: torch.as_tensor(lease, device=...)
#                    (CAI; torch ignores its stream key: the consumer orders
#                    its stream after it), stream-ordered release.
#   (-frameworks picks which of these four run; "host", the same loop with
#   the bytes read on the host, runs on the simulator too.)
#   *-pidns          torch-ring and cli-ring with VMM, the producer and the
#                    consumer each under its own unshare --pid (two
#                    containers); skipped with a note where unshare is refused.
#   trainer          examples/python/trainer.py --batches N (VMM, same GPU):
#                    ok when it exits 0, its last line says "trainer: ok: N
#                    batches" and N is the producer's count; skipped when it
#                    says "trainer: skipped".
# The producer makes -count batches (default 2000; 300 for cli-ring; at most
# 500 for the cupy, jax, torch-cai and trainer cases), with -fill (the
# pattern, PROTOCOL.md 4.2) and an interprocess event. A case passes when
# both processes exit 0 and the consumer verified every batch it got (the
# cupy, jax, torch-cai and trainer cases: all the producer's batches); a
# consumer that exits 3 with a "skipped" reason (no framework, no GPU for
# it) is skipped, not failed. Every process has a timeout; a failing case
# does not stop the others. Prints a table; logs in $OUT. Exit 1 if a case
# failed.
# About 2 minutes on one GPU.
#
# Python: $PYTHON, else python3; where that has no msgpack, .gpu/pylib (a
# pure-Python msgpack, from scripts/gpu-test), else /usr/bin/python3 if it
# has msgpack (python3-msgpack; e.g. python3 is a pyenv shim without it).
#
# On the simulator (no GPU or CUDASHARE_DRIVER=sim) the torch, cupy, jax and
# trainer cases skip and cli-ring runs with VMM only (the simulator's legacy
# IPC memory is not reachable from Python).
set -uo pipefail

cd "$(dirname "$0")/.."
count=2000
frameworks="cupy cupy-dlpack jax torch-cai"
while [ $# -gt 0 ]; do
	case $1 in
	-count) count=$2; shift 2 ;;
	-frameworks) frameworks=$2; shift 2 ;;
	-h | -help | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "python-gpu-check: unknown argument $1" >&2; exit 2 ;;
	esac
done
OUT=${OUT:-$(mktemp -d /tmp/python-gpu-check.XXXXXX)}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/cudashare-pycheck.XXXXXX)
chmod 700 "$work" # the socket's directory: this user's only
trap 'rm -rf "$work"' EXIT
sock=$work/s

BIN=${CUDASHARE_BIN_DIR:-.gpu/bin}
if [ ! -x "$BIN/producer" ] || [ ! -x "$BIN/cudashare" ]; then
	if command -v go >/dev/null; then
		BIN=$work/bin
		CGO_ENABLED=0 go build -o "$BIN/" ./examples/producer ./cmd/cudashare || exit 1
	else
		echo "python-gpu-check: no $BIN/producer; run scripts/gpu-test where Go is, and carry .gpu" >&2
		exit 1
	fi
fi
PY=${PYTHON:-python3}
PYCS=(env "PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}")
if ! timeout 60 "$PY" -c 'import msgpack' 2>/dev/null; then
	if [ -d .gpu/pylib/msgpack ]; then
		PYCS=(env "PYTHONPATH=$PWD/python:$PWD/.gpu/pylib${PYTHONPATH:+:$PYTHONPATH}" MSGPACK_PUREPYTHON=1)
	elif [ -z "${PYTHON:-}" ] && timeout 60 /usr/bin/python3 -c 'import msgpack' 2>/dev/null; then
		PY=/usr/bin/python3
	fi
fi
if ! timeout 60 "${PYCS[@]}" "$PY" -c 'import msgpack'; then
	echo "python-gpu-check: $PY has no msgpack (and no .gpu/pylib; set PYTHON): nothing to run" >&2
	exit 1
fi

export CUDASHARE_SIM_DIR=${CUDASHARE_SIM_DIR:-$work/sim}
timeout -k 5 60 "$BIN/cudashare" devices >"$OUT/devices.txt" 2>&1
driver=$(sed -n 's/^driver: \([a-z]*\).*/\1/p' "$OUT/devices.txt")
ngpus=$(grep -cE '^  [0-9]+  GPU-' "$OUT/devices.txt")
if [ -z "$driver" ] || [ "$ngpus" -lt 1 ]; then
	echo "python-gpu-check: no usable driver or GPU:" >&2
	cat "$OUT/devices.txt" >&2
	exit 1
fi
# The cupy, jax, torch-cai and trainer cases: at most 500 batches each.
icount=$((count < 500 ? count : 500))
echo "python-gpu-check: driver $driver, $ngpus GPU(s), $count batches per case ($icount for the framework cases);" \
	"$PY $(timeout 60 "$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1); logs in $OUT"
command -v nvidia-smi >/dev/null && timeout -k 5 60 nvidia-smi -L

results=()
failed=0
WRAP=() # the pidns cases run the producer and the consumer each in its own PID namespace
want_n="" # set: the consumer must have got every one of the producer's COUNT batches
# case NAME SHARING DEV CDEV COUNT -- CONSUMER... -- PRODUCER_ARGS...
run_case() {
	local name=$1 sh=$2 d=$3 c=$4 n=$5
	shift 5
	shift # --
	local ccmd=()
	while [ "$1" != -- ]; do ccmd+=("$1"); shift; done
	shift
	local label="$name-$sh-gpu$d$c"
	echo "== $label"
	timeout -k 10 180 "${WRAP[@]}" "$BIN/producer" -socket "$sock" -device "$d" -sharing "$sh" -count "$n" -consumers 1 \
		-wait 60s -shutdown-timeout 20s -json "$@" >"$OUT/$label.producer.json" 2>"$OUT/$label.producer.log" &
	local ppid=$!
	timeout -k 10 150 "${WRAP[@]}" "${ccmd[@]}" >"$OUT/$label.consumer.json" 2>"$OUT/$label.consumer.log"
	local cexit=$?
	# A consumer that failed or skipped (trainer.py skips with exit 0) took
	# no batch: the producer would wait for one until its -wait.
	if [ "$cexit" != 0 ] || grep -qs '^trainer: skipped' "$OUT/$label.consumer.json"; then
		kill -TERM "$ppid" 2>/dev/null
	fi
	wait "$ppid"
	local pexit=$?
	local line
	line=$("$PY" - "$OUT/$label.producer.json" "$OUT/$label.consumer.json" "$pexit" "$cexit" "$label" "${want_n:+$n}" <<'PY'
import json, re, sys
def last(p):
    try:
        ls = [l for l in open(p) if l.strip().startswith("{")]
        return json.loads(ls[-1]) if ls else {}
    except (OSError, ValueError):
        return {}
def trainer(p):
    # examples/python/trainer.py prints lines, not JSON.
    c = {}
    try:
        ls = open(p).read().splitlines()
    except OSError:
        return c
    for l in ls:
        m = re.match(r"trainer: skipped: (.*)", l)
        if m:
            c["skipped"] = m.group(1)
        m = re.match(r"trainer: (\d+) handoffs in [0-9.]+s: (\d+)/s; (\d+) wrong bytes", l)
        if m:
            c.update(handoffs=int(m.group(1)), handoffs_per_s=int(m.group(2)),
                     check="every byte of every batch on the GPU (trainer.py): %s wrong" % m.group(3))
        m = re.match(r"trainer: ok: (\d+) batches", l)
        if m:
            c["verified"] = int(m.group(1))
        if l.startswith("trainer: FAILED:"):
            c["error"] = l
    if "handoffs" in c:
        c["verify_errors"] = c["handoffs"] - c.get("verified", 0)
    return c
p, c = last(sys.argv[1]), last(sys.argv[2])
pexit, cexit, label, want = sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
if not c and label.startswith("trainer"):
    c = trainer(sys.argv[2])
if c.get("skipped") and (cexit == "3" or (cexit == "0" and label.startswith("trainer"))):
    print("%s|skipped|%s" % (label, c["skipped"].replace("|", "/"))); sys.exit()
res = "ok"
why = []
if pexit != "0" or cexit != "0":
    res = "FAILED"
    why.append("producer exit %s, consumer exit %s" % (pexit, cexit))
if c.get("error"):
    res = "FAILED"; why.append(c["error"])
if p.get("sharing") and p["sharing"] not in label:
    res = "FAILED"; why.append("the producer took %s" % p["sharing"])
n, ver, bad = c.get("handoffs", 0), c.get("verified", 0), c.get("verify_errors", 0)
if res == "ok" and (n == 0 or ver != n or bad):
    res = "FAILED"; why.append("%d batches, %d verified, %d wrong" % (n, ver, bad))
if res == "ok" and want and n != int(want):
    res = "FAILED"; why.append("%d batches of the producer's %s" % (n, want))
extra = ""
if c.get("zero_copy"):
    extra += ", zero-copy %s" % c["zero_copy"]
for k in ("cupy_cai_sync", "cai_pointer_device", "dlpack_paths", "capsule_via", "jax_api"):
    if c.get(k):
        extra += ", %s %s" % (k.replace("_", " "), c[k])
details = "%s batches, %s verified, %s wrong, %s/s, sharing %s, %s%s%s" % (
    n, ver, bad, c.get("handoffs_per_s"), p.get("sharing", "?"), c.get("check", "verify " + str(c.get("verify"))),
    extra, ("; " + "; ".join(why)) if why else "")
print("%s|%s|%s" % (label, res, details.replace("|", "/")))
PY
)
	[ -z "$line" ] && line="$label|FAILED|no report (producer exit $pexit, consumer exit $cexit)"
	case $line in
	*"|FAILED|"*)
		failed=$((failed + 1))
		echo "   FAILED; last lines of the logs:"
		tail -n 5 "$OUT/$label.producer.log" "$OUT/$label.consumer.log" | sed 's/^/   /' ;;
	esac
	echo "   ${line#*|}"
	results+=("$line")
}

pairs=("0 0")
[ "$ngpus" -ge 2 ] && pairs+=("0 1")
for pair in "${pairs[@]}"; do
	read -r d c <<<"$pair"
	for sh in ipc vmm; do
		run_case torch-ring "$sh" "$d" "$c" "$count" -- "${PYCS[@]}" "$PY" bench/py_consumer.py --socket "$sock" \
			--device "$c" --wait 60 --work full -- -ring 8 -size 1MiB
		run_case torch-ring-dlpack "$sh" "$d" "$c" "$count" -- "${PYCS[@]}" "$PY" bench/py_consumer.py --socket "$sock" \
			--device "$c" --wait 60 --work full --view dlpack -- -ring 8 -size 1MiB
		run_case torch-fresh "$sh" "$d" "$c" "$count" -- "${PYCS[@]}" "$PY" bench/py_consumer.py --socket "$sock" \
			--device "$c" --wait 60 --work full -- -fresh -ring 8 -size 64MiB
		if [ "$driver" = sim ] && [ "$sh" = ipc ]; then
			results+=("cli-ring-$sh-gpu$d$c|skipped|the simulator's legacy IPC memory is not reachable from Python")
		else
			run_case cli-ring "$sh" "$d" "$c" 300 -- "${PYCS[@]}" "$PY" -m cudashare consume --socket "$sock" \
				--device "$c" --wait 60 --verify full --workers 1 -- -ring 8 -size 1MiB
		fi
		want_n=1
		for fw in $frameworks; do
			if [ "$fw" = host ] && [ "$driver" = sim ] && [ "$sh" = ipc ]; then
				results+=("$fw-ring-$sh-gpu$d$c|skipped|the simulator's legacy IPC memory is not reachable from Python")
				continue
			fi
			run_case "$fw-ring" "$sh" "$d" "$c" "$icount" -- "${PYCS[@]}" "$PY" bench/py_interop.py --framework "$fw" \
				--socket "$sock" --device "$c" --wait 60 -- -ring 8 -size 1MiB
		done
		want_n=""
	done
done
want_n=1
run_case trainer vmm 0 0 "$icount" -- "${PYCS[@]}" "$PY" examples/python/trainer.py --socket "$sock" --device 0 \
	--wait 60 --batches "$icount" -- -ring 8 -size 1MiB
want_n=""
# Sibling PID namespaces (two containers): the producer under one
# unshare, the Python consumer under another; VMM only (legacy IPC handles
# are refused between siblings). Each side reads its peer's pid as 0, so
# no event handle crosses: the producer waits on the host before offering
# and the consumer on its stream before releasing (PROTOCOL.md 3.1).
if timeout -k 5 30 unshare --pid --fork --kill-child --mount-proc true 2>"$OUT/unshare.log"; then
	WRAP=(unshare --pid --fork --kill-child --mount-proc)
	run_case torch-ring-pidns vmm 0 0 "$count" -- "${PYCS[@]}" "$PY" bench/py_consumer.py --socket "$sock" \
		--device 0 --wait 60 --work full -- -ring 8 -size 1MiB
	run_case cli-ring-pidns vmm 0 0 300 -- "${PYCS[@]}" "$PY" -m cudashare consume --socket "$sock" \
		--device 0 --wait 60 --verify full --workers 1 -- -ring 8 -size 1MiB
	WRAP=()
else
	results+=("pidns (sibling PID namespaces)|skipped|unshare --pid refused here: $(head -c 200 "$OUT/unshare.log")")
fi
if [ "$ngpus" -lt 2 ]; then
	results+=("across GPUs (consumer on GPU 1)|skipped|one GPU: the across-GPU cases need two")
fi

echo
echo "| case | result | details |"
echo "| --- | --- | --- |"
for r in "${results[@]}"; do
	IFS='|' read -r a b rest <<<"$r"
	echo "| $a | $b | $rest |"
done
if [ "$failed" -gt 0 ]; then
	echo "python-gpu-check: $failed case(s) FAILED" >&2
	exit 1
fi
