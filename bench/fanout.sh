#!/usr/bin/env bash
# bench/fanout.sh: how the producer's cost per handoff grows with consumers.
# One producer offers a ring of 64 x 1 MiB (the handoff alone: -fill=false,
# consumers -verify none -credits 8 -workers 1) to N consumer processes; then
# the same with -broadcast (every batch to every consumer); then, with several
# GPUs, one producer per GPU each serving one consumer on every GPU. On the GPU
# machine, from the repository root, after scripts/gpu-test has built .gpu/bin:
#
#   bash bench/fanout.sh [-seconds N] [-n "1 2 4 8 16 32"] [-broadcast-n "1 2 4 8"]
#                        [-bin DIR] [-label PREFIX] [-spread] [-no-mesh] [-shm true|false]
#                        [-profile "16 b8"] [-ring N] [-credits N] [-gpus N]
#   (device tool: run(command="bash bench/fanout.sh -seconds 3", carry=[".gpu"]))
#
# Each row prints: handoffs/s in all (sum of the consumers' rates), the
# slowest and fastest consumer's rate and their ratio (fairness), the
# producer's CPU time per batch (every thread, user and system) and the
# consumers' mean CPU time per handoff. Broadcast rows print each consumer's
# rate (batches received per second) and the producer's CPU per batch and per
# consumer reached. -spread puts consumer i on GPU i mod the number of GPUs
# (the producer stays on GPU 0); -bin runs another build (to compare two
# commits in one call); -profile writes the producer's CPU profile
# ($OUT/NAME.producer.pprof) of the rows named by their consumer count ("b8":
# broadcast to 8); -gpus sets the number of GPUs (default: nvidia-smi's count;
# with the simulator, CUDASHARE_SIM_TOPOLOGY=N makes N). Without a GPU it runs on the simulated driver.
# JSON of every process goes to $OUT (or a temporary directory), a markdown
# table to stdout. Every process runs under timeout.
set -uo pipefail
cd "$(dirname "$0")/.."

secs=3
ns="1 2 4 8 16 32"
bns="1 2 4 8"
BIN=${CUDASHARE_BIN_DIR:-.gpu/bin}
label=""
spread=0
mesh=1
shm=true
profile=""
ring=64
credits=8
gpus=""
while [ $# -gt 0 ]; do
	case $1 in
	-seconds) secs=$2; shift 2 ;;
	-n) ns=$2; shift 2 ;;
	-broadcast-n) bns=$2; shift 2 ;;
	-bin) BIN=$2; shift 2 ;;
	-label) label=$2; shift 2 ;;
	-spread) spread=1; shift ;;
	-no-mesh) mesh=0; shift ;;
	-shm) shm=$2; shift 2 ;;
	-profile) profile=" $2 "; shift 2 ;;
	-ring) ring=$2; shift 2 ;;
	-credits) credits=$2; shift 2 ;;
	-gpus) gpus=$2; shift 2 ;;
	*) echo "fanout.sh: unknown argument $1" >&2; exit 2 ;;
	esac
done
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
[ -n "$gpus" ] || gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 1 ] || gpus=1
dir=$(mktemp -d /tmp/cudashare-fanout.XXXXXX)
chmod 700 "$dir"
limit=$((secs * 3 + 90))

# summarize NAME PRODUCER_JSON CONSUMER_JSON...: one markdown row.
summarize() {
	python3 - "$@" <<'EOF'
import json, sys
name, pj, cjs = sys.argv[1], sys.argv[2], sys.argv[3:]
def last(path):
    try:
        lines = [l for l in open(path).read().splitlines() if l.strip().startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except OSError:
        return {}
p = last(pj)
cs = [last(c) for c in cjs]
rates = [c.get("handoffs_per_s", 0.0) for c in cs]
cpu = [c.get("cpu_us_per_handoff", 0.0) for c in cs if c.get("handoffs")]
bad = [c for c in cs if c.get("exit", 1) != 0] + ([p] if p.get("exit", 1) != 0 else [])
total = sum(rates)
lo, hi = (min(rates), max(rates)) if rates else (0, 0)
fair = lo / hi if hi else 0
pcpu = p.get("cpu_us_per_batch", 0.0)
bcast = p.get("broadcast", False)
reached = p.get("offers", 0) / p["batches"] if p.get("batches") else 0
per = pcpu / reached if reached else 0
note = "" if not bad else " FAILED: " + "; ".join((c.get("error") or c.get("end") or "exit %s" % c.get("exit")) for c in bad)
if bcast:
    print(f"| {name} | {len(cs)} | {p.get('batches_per_s', 0):,.0f} batches/s | {lo:,.0f} / {hi:,.0f} each ({fair:.2f}) | {pcpu:.1f} ({per:.1f} per consumer reached) | {sum(cpu)/max(len(cpu),1):.1f} |{note}")
else:
    print(f"| {name} | {len(cs)} | {total:,.0f} | {lo:,.0f} / {hi:,.0f} ({fair:.2f}) | {pcpu:.1f} | {sum(cpu)/max(len(cpu),1):.1f} |{note}")
EOF
}

# row NAME N PRODUCER_DEVICE PROFILE_KEY [PRODUCER_ARGS...]: one producer, N
# consumers.
row() {
	local name=$1 n=$2 pdev=$3 key=$4
	shift 4
	local sock="$dir/$name.sock" pids=() cj=() prof=()
	[[ $profile == *" $key "* ]] && prof=(-cpuprofile "$OUT/$name.producer.pprof")
	timeout -k 5 "$limit" "$BIN/producer" -socket "$sock" -device "$pdev" -duration "${secs}s" -consumers "$n" \
		-wait 60s -ring "$ring" -size 1MiB -fill=false -shm="$shm" -json "${prof[@]}" "$@" >"$OUT/$name.producer.json" 2>"$OUT/$name.producer.log" &
	local ppid=$!
	for i in $(seq 0 $((n - 1))); do
		local cdev=$pdev
		[ $spread = 1 ] && cdev=$((i % gpus))
		timeout -k 5 "$limit" "$BIN/consumer" -socket "$sock" -device "$cdev" -wait 60s -verify none -credits "$credits" \
			-workers 1 -json >"$OUT/$name.c$i.json" 2>"$OUT/$name.c$i.log" &
		pids+=($!)
		cj+=("$OUT/$name.c$i.json")
	done
	for p in "${pids[@]}"; do wait "$p"; done
	wait "$ppid"
	summarize "$label$name" "$OUT/$name.producer.json" "${cj[@]}"
}

echo "fan-out: ring of $ring x 1 MiB, handoff alone, consumers -credits $credits -workers 1, ${secs}s a row, $gpus GPU(s), shm=$shm, bin $BIN"
echo
echo "| row | consumers | handoffs/s in all | per consumer min / max (min/max) | producer CPU µs a batch | consumer CPU µs a handoff |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
where=gpu0
[ $spread = 1 ] && where=spread
for n in $ns; do
	row "one-$where-n$n" "$n" 0 "$n"
done
for n in $bns; do
	row "broadcast-$where-n$n" "$n" 0 "b$n" -broadcast
done

# Every producer to every GPU: one producer per GPU, each with one consumer on
# every GPU, all at once.
if [ $mesh = 1 ] && [ "$gpus" -gt 1 ]; then
	all=() rows=()
	for p in $(seq 0 $((gpus - 1))); do
		sock="$dir/mesh$p.sock"
		timeout -k 5 "$limit" "$BIN/producer" -socket "$sock" -device "$p" -duration "${secs}s" -consumers "$gpus" \
			-wait 60s -ring 64 -size 1MiB -fill=false -shm="$shm" -json >"$OUT/mesh-p$p.producer.json" 2>"$OUT/mesh-p$p.producer.log" &
		all+=($!)
	done
	for p in $(seq 0 $((gpus - 1))); do
		for c in $(seq 0 $((gpus - 1))); do
			timeout -k 5 "$limit" "$BIN/consumer" -socket "$dir/mesh$p.sock" -device "$c" -wait 60s -verify none \
				-credits 8 -workers 1 -json >"$OUT/mesh-p$p.c$c.json" 2>"$OUT/mesh-p$p.c$c.log" &
			all+=($!)
		done
	done
	for p in "${all[@]}"; do wait "$p"; done
	for p in $(seq 0 $((gpus - 1))); do
		summarize "${label}mesh-producer$p" "$OUT/mesh-p$p.producer.json" "$OUT"/mesh-p$p.c*.json
	done
fi
rm -rf "$dir"
