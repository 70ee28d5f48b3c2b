#!/usr/bin/env bash
# bench/top-cost.sh: what watching a producer costs. One producer offers a
# ring of 64 x 1 MiB (the handoff alone: -fill=false, consumers -verify none)
# to N consumers for -seconds; each row is repeated -reps times, the modes
# interleaved so that drift hits them alike:
#   base     nothing watches;
#   top10hz  `cudashare top -interval 100ms -json` runs throughout (10 snapshots/s);
#   scrape1s the producer serves -metrics and curl scrapes /metrics every second.
# It prints, per mode, the handoffs/s of every run, their median and the
# median's difference from base, so that a difference is read against the
# spread of the runs. On the GPU machine, from the repository root, after
# scripts/gpu-test has built .gpu/bin:
#
#   bash bench/top-cost.sh [-seconds N] [-n N] [-reps N] [-bin DIR]
#   (device tool: run(command="bash bench/top-cost.sh -seconds 5 -reps 5", carry=[".gpu"]))
#
# Without a GPU it runs on the simulated driver (build the binaries with
# `go build -o DIR/ ./examples/producer ./examples/consumer ./cmd/cudashare`
# and pass -bin DIR). Every process runs under timeout.
set -uo pipefail
cd "$(dirname "$0")/.."

secs=3
n=2
reps=3
BIN=${CUDASHARE_BIN_DIR:-.gpu/bin}
while [ $# -gt 0 ]; do
	case "$1" in
	-seconds) secs=$2; shift 2 ;;
	-n) n=$2; shift 2 ;;
	-reps) reps=$2; shift 2 ;;
	-bin) BIN=$2; shift 2 ;;
	*) echo "usage: $0 [-seconds N] [-n N] [-reps N] [-bin DIR]" >&2; exit 2 ;;
	esac
done
for b in producer consumer cudashare; do
	[ -x "$BIN/$b" ] || { echo "no $BIN/$b: build the binaries first (see the header)" >&2; exit 2; }
done
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
dir=$(mktemp -d /tmp/topcost.XXXXXX)
chmod 700 "$dir"
port=$((20000 + RANDOM % 20000))
trap 'rm -rf "$dir"' EXIT

# run MODE REP: one producer, n consumers, and the watcher of MODE.
run() {
	local mode=$1 rep=$2 sock=$dir/p.sock extra=()
	[ "$mode" = scrape1s ] && extra=(-metrics "127.0.0.1:$port")
	timeout $((secs + 60)) "$BIN/producer" -socket "$sock" -ring 64 -size 1MiB -fill=false -consumers "$n" \
		-duration "${secs}s" -wait 30s -json "${extra[@]}" >"$out/$mode.$rep.producer.json" 2>"$out/$mode.$rep.producer.err" &
	local prod=$!
	local cons=()
	for i in $(seq "$n"); do
		timeout $((secs + 60)) "$BIN/consumer" -socket "$sock" -wait 20s -verify none -credits 8 -workers 1 -json \
			>"$out/$mode.$rep.consumer$i.json" 2>/dev/null &
		cons+=($!)
	done
	local watcher=""
	case "$mode" in
	top10hz)
		# Attaches once the socket is there, and watches until the producer ends.
		(for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
		 timeout $((secs + 60)) "$BIN/cudashare" top -interval 100ms -json "$sock" >"$out/$mode.$rep.top.json" 2>/dev/null) &
		watcher=$! ;;
	scrape1s)
		(while kill -0 $prod 2>/dev/null; do curl -s -m 2 "http://127.0.0.1:$port/metrics" >/dev/null; sleep 1; done) &
		watcher=$! ;;
	esac
	wait $prod "${cons[@]}"
	[ -n "$watcher" ] && { kill $watcher 2>/dev/null; wait $watcher 2>/dev/null; }
	python3 - "$out/$mode.$rep.producer.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(f"{r['batches_per_s']:.0f}")
PY
}

declare -A rates
for rep in $(seq "$reps"); do
	for mode in base top10hz scrape1s; do
		r=$(run $mode "$rep")
		rates[$mode]="${rates[$mode]:-} $r"
	done
done
echo "| mode | handoffs/s of each run | median | vs base |"
echo "| --- | --- | --- | --- |"
base=""
for mode in base top10hz scrape1s; do
	python3 - "$mode" "${rates[$mode]}" "$base" <<'PY'
import statistics, sys
mode, runs, base = sys.argv[1], [float(x) for x in sys.argv[2].split()], sys.argv[3]
med = statistics.median(runs)
vs = f"{(med / float(base) - 1) * 100:+.1f}%" if base else "-"
print(f"| {mode} | {' '.join(f'{r:.0f}' for r in runs)} | {med:.0f} | {vs} |")
PY
	[ $mode = base ] && base=$(python3 -c "import statistics,sys; print(statistics.median([float(x) for x in sys.argv[1:]]))" ${rates[base]})
done
echo "(n=$n consumers, ${secs}s per run, $reps runs per mode, binaries $BIN; JSON in $out)"
