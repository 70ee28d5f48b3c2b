#!/usr/bin/env bash
# bench/python-gpu-check.sh: the Go example producer to the Python consumer
# (python/), legacy CUDA IPC and VMM, verifying every batch. On the GPU
# machine, from the repository root, after scripts/gpu-test:
#
#   bash bench/python-gpu-check.sh [-count N]
#   (device tool: run(command="bash bench/python-gpu-check.sh", carry=[".gpu"]))
#
# Cases, each for -sharing ipc and -sharing vmm, same GPU, then with two GPUs
# the consumer on GPU 1 (skipped with a note on one GPU):
#   torch-ring   bench/py_consumer.py --work full: ring of 8 x 1 MiB, each
#                lease a torch tensor (DLPack, no copy), every byte compared
#                with the batch's pattern on the GPU, stream-ordered release.
#   torch-fresh  the same with fresh 64 MiB buffers from an arena.
#   cli-ring     python -m cudashare consume --verify full: every byte of
#                every batch copied back to the host and checked (no torch).
#   *-pidns      torch-ring and cli-ring with VMM, the producer and the
#                consumer each under its own unshare --pid (two containers);
#                skipped with a note where unshare is refused.
# The producer makes -count batches (default 2000; 300 for cli-ring), with
# -fill (the pattern, PROTOCOL.md 4.2) and an interprocess event. Every
# process has a timeout; a failing case does not stop the others.
# Prints a table; logs in $OUT. Exit 1 if a case failed (skipped is not).
# About 1 minute on one GPU.
#
# On the simulator (no GPU or CUDASHARE_DRIVER=sim) the torch cases skip
# and cli-ring runs with VMM only (the simulator's legacy IPC memory is not
# reachable from Python).
set -uo pipefail

cd "$(dirname "$0")/.."
count=2000
while [ $# -gt 0 ]; do
	case $1 in
	-count) count=$2; shift 2 ;;
	-h | -help | --help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "python-gpu-check: unknown argument $1" >&2; exit 2 ;;
	esac
done
OUT=${OUT:-$(mktemp -d /tmp/python-gpu-check.XXXXXX)}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/cudashare-pycheck.XXXXXX)
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
PYCS=(env "PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}")
if ! python3 -c 'import msgpack' 2>/dev/null && [ -d .gpu/pylib/msgpack ]; then
	PYCS=(env "PYTHONPATH=$PWD/python:$PWD/.gpu/pylib${PYTHONPATH:+:$PYTHONPATH}" MSGPACK_PUREPYTHON=1)
fi
if ! "${PYCS[@]}" python3 -c 'import msgpack'; then
	echo "python-gpu-check: python3 has no msgpack (and no .gpu/pylib): nothing to run" >&2
	exit 1
fi

export CUDASHARE_SIM_DIR=${CUDASHARE_SIM_DIR:-$work/sim}
"$BIN/cudashare" devices >"$OUT/devices.txt" 2>&1
driver=$(sed -n 's/^driver: \([a-z]*\).*/\1/p' "$OUT/devices.txt")
ngpus=$(grep -cE '^  [0-9]+  GPU-' "$OUT/devices.txt")
if [ -z "$driver" ] || [ "$ngpus" -lt 1 ]; then
	echo "python-gpu-check: no usable driver or GPU:" >&2
	cat "$OUT/devices.txt" >&2
	exit 1
fi
echo "python-gpu-check: driver $driver, $ngpus GPU(s), $count batches per case; logs in $OUT"
command -v nvidia-smi >/dev/null && nvidia-smi -L

results=()
failed=0
WRAP=() # the pidns cases run the producer and the consumer each in its own PID namespace
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
	[ "$cexit" != 0 ] && kill -TERM "$ppid" 2>/dev/null
	wait "$ppid"
	local pexit=$?
	local line
	line=$(python3 - "$OUT/$label.producer.json" "$OUT/$label.consumer.json" "$pexit" "$cexit" "$label" <<'PY'
import json, sys
def last(p):
    try:
        ls = [l for l in open(p) if l.strip().startswith("{")]
        return json.loads(ls[-1]) if ls else {}
    except (OSError, ValueError):
        return {}
p, c = last(sys.argv[1]), last(sys.argv[2])
pexit, cexit, label = sys.argv[3], sys.argv[4], sys.argv[5]
if cexit == "3" and c.get("skipped"):
    print("%s|skipped|%s" % (label, c["skipped"])); sys.exit()
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
print("%s|%s|%s batches, %s verified, %s wrong, %s/s, sharing %s, %s%s" % (
    label, res, n, ver, bad, c.get("handoffs_per_s"), p.get("sharing", "?"), c.get("check", "verify " + str(c.get("verify"))),
    ("; " + "; ".join(why)) if why else ""))
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
		run_case torch-ring "$sh" "$d" "$c" "$count" -- "${PYCS[@]}" python3 bench/py_consumer.py --socket "$sock" \
			--device "$c" --wait 60 --work full -- -ring 8 -size 1MiB
		run_case torch-fresh "$sh" "$d" "$c" "$count" -- "${PYCS[@]}" python3 bench/py_consumer.py --socket "$sock" \
			--device "$c" --wait 60 --work full -- -fresh -ring 8 -size 64MiB
		if [ "$driver" = sim ] && [ "$sh" = ipc ]; then
			results+=("cli-ring-$sh-gpu$d$c|skipped|the simulator's legacy IPC memory is not reachable from Python")
			continue
		fi
		run_case cli-ring "$sh" "$d" "$c" 300 -- "${PYCS[@]}" python3 -m cudashare consume --socket "$sock" \
			--device "$c" --wait 60 --verify full --workers 1 -- -ring 8 -size 1MiB
	done
done
# Sibling PID namespaces (two containers): the producer under one
# unshare, the Python consumer under another; VMM only (legacy IPC handles
# are refused between siblings). Each side reads its peer's pid as 0, so
# no event handle crosses: the producer waits on the host before offering
# and the consumer on its stream before releasing (PROTOCOL.md 3.1).
if unshare --pid --fork --kill-child --mount-proc true 2>"$OUT/unshare.log"; then
	WRAP=(unshare --pid --fork --kill-child --mount-proc)
	run_case torch-ring-pidns vmm 0 0 "$count" -- "${PYCS[@]}" python3 bench/py_consumer.py --socket "$sock" \
		--device 0 --wait 60 --work full -- -ring 8 -size 1MiB
	run_case cli-ring-pidns vmm 0 0 300 -- "${PYCS[@]}" python3 -m cudashare consume --socket "$sock" \
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
