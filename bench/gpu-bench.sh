#!/usr/bin/env bash
# bench/gpu-bench.sh: cudashare's handoff benchmark against torch.multiprocessing,
# side by side in one run. On the GPU machine, from the repository root, after
# scripts/gpu-test has built the binaries into .gpu/bin here:
#
#   bash bench/gpu-bench.sh [-seconds N] [-read-size SIZE] [-workers N]
#   (with the device tool: run(command="bash bench/gpu-bench.sh", carry=[".gpu"]))
#
# Rows, each run for about -seconds (default 5):
#   (a) a ring of 8 reused 1 MiB buffers, (b) a fresh 64 MiB buffer per batch
#       (cudashare: sub-allocated from an arena), producer and one consumer on
#       GPU 0; then, with two GPUs, the consumer on GPU 1;
#   cudashare with -verify byte (one byte copied back per batch: what
#       torch_mp.py's .item() check does) and with -verify none, labelled;
#   torch.multiprocessing (bench/torch_mp.py) in the same modes;
#   the read test: a consumer copies a whole shared buffer (default 1 GiB)
#       device-to-device, against a local buffer of the same size on the same GPU.
# One failing row does not stop the others. JSON lines go to $OUT/bench.jsonl,
# logs to $OUT/*.log, the markdown table to $OUT/bench.md; the table is printed
# last. Exit 1 if any row failed (a skipped torch row is not a failure).
#
# Without a GPU (or with CUDASHARE_DRIVER=sim) it runs on the simulated driver, with
# -seconds 2 and a 64 MiB read test unless told otherwise, so that its plumbing
# is tested anywhere; torch rows are skipped where torch is missing.
set -uo pipefail

cd "$(dirname "$0")/.."
cmdline="bash bench/gpu-bench.sh${*:+ $*}"
secs= read_size= workers=2
while [ $# -gt 0 ]; do
	case $1 in
	-seconds) secs=$2; shift 2 ;;
	-read-size) read_size=$2; shift 2 ;;
	-workers) workers=$2; shift 2 ;;
	-h | -help | --help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "gpu-bench: unknown argument $1 (-h for help)" >&2; exit 2 ;;
	esac
done

OUT=${OUT:-$(mktemp -d /tmp/gpu-bench.XXXXXX)}
mkdir -p "$OUT"
: >"$OUT/bench.jsonl"
work=$(mktemp -d /tmp/cudashare-bench.XXXXXX) # mode 0700: the socket's directory
trap 'rm -rf "$work"' EXIT

# The binaries: CUDASHARE_BIN_DIR, else .gpu/bin, else built here if Go is.
BIN=${CUDASHARE_BIN_DIR:-.gpu/bin}
if [ ! -x "$BIN/producer" ] || [ ! -x "$BIN/consumer" ] || [ ! -x "$BIN/cudashare" ]; then
	if command -v go >/dev/null; then
		BIN=$work/bin
		echo "gpu-bench: building the binaries into $BIN"
		CGO_ENABLED=0 go build -o "$BIN/" ./examples/producer ./examples/consumer ./cmd/cudashare || exit 1
	else
		echo "gpu-bench: no binaries in $BIN; run scripts/gpu-test where Go is, and carry .gpu" >&2
		exit 1
	fi
fi
if ! command -v python3 >/dev/null; then
	echo "gpu-bench: python3 is needed for torch and for the table" >&2
	exit 1
fi

# Which driver, how many GPUs. The simulator, if it runs, gets a state
# directory of its own (the real driver ignores it).
export CUDASHARE_SIM_DIR=${CUDASHARE_SIM_DIR:-$work/sim}
"$BIN/cudashare" devices >"$OUT/devices.txt" 2>&1
driver=$(sed -n 's/^driver: \([a-z]*\).*/\1/p' "$OUT/devices.txt")
ngpus=$(grep -cE '^  [0-9]+  GPU-' "$OUT/devices.txt")
if [ -z "$driver" ] || [ "$ngpus" -lt 1 ]; then
	echo "gpu-bench: no usable driver or GPU:" >&2
	cat "$OUT/devices.txt" >&2
	exit 1
fi
if [ "$driver" = sim ]; then
	secs=${secs:-2} read_size=${read_size:-64MiB}
	echo "gpu-bench: SIMULATED driver (no GPU or CUDASHARE_DRIVER=sim): the figures test the plumbing, not the hardware"
else
	secs=${secs:-5} read_size=${read_size:-1GiB}
fi
{
	echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) gpu-bench: driver $driver, $ngpus GPU(s), ${secs}s per row, read test $read_size"
	cat "$OUT/devices.txt"
	command -v nvidia-smi >/dev/null && nvidia-smi -L
	[ -f .gpu/run.sh ] && grep -m1 '^BUILT=' .gpu/run.sh
} | tee "$OUT/env.txt"

failed=0
sock=$work/bench.sock

# ours LABEL MODE SIZE DEVICE CONSUMER_DEVICE VERIFY PRODUCER_ARGS...
ours() {
	local label=$1 mode=$2 size=$3 dev=$4 cdev=$5 verify=$6
	shift 6
	echo "== $label"
	local limit=$((secs * 2 + 120))
	timeout -k 10 "$limit" "$BIN/producer" -socket "$sock" -device "$dev" -duration "${secs}s" \
		-consumers 1 -wait 60s -json "$@" >"$OUT/$label.producer.json" 2>"$OUT/$label.producer.log" &
	local ppid=$!
	timeout -k 10 "$limit" "$BIN/consumer" -socket "$sock" -device "$cdev" -wait 60s -verify "$verify" \
		-workers "${row_workers:-$workers}" -credits "${row_credits:-16}" -json >"$OUT/$label.consumer.json" 2>"$OUT/$label.consumer.log"
	local cexit=$?
	# A consumer that failed leaves the producer waiting for it: end it
	# (timeout passes the signal on; the producer shuts down gracefully).
	[ "$cexit" != 0 ] && kill -TERM "$ppid" 2>/dev/null
	wait "$ppid"
	local pexit=$?
	python3 bench/report.py row "$label" "$OUT/$label.producer.json" "$OUT/$label.consumer.json" "$pexit" "$cexit" \
		mode="$mode" size="$size" ring=8 device="$dev" consumer_device="$cdev" verify="$verify" workers="${row_workers:-$workers}" |
		tee -a "$OUT/bench.jsonl"
	if [ "$pexit" != 0 ] || [ "$cexit" != 0 ]; then
		failed=$((failed + 1))
		echo "   FAILED (producer exit $pexit, consumer exit $cexit); last lines of the logs:"
		tail -n 5 "$OUT/$label.producer.log" "$OUT/$label.consumer.log" | sed 's/^/   /'
	fi
}

# torchrow LABEL ARGS...
torchrow() {
	local label=$1
	shift
	echo "== $label"
	timeout -k 10 $((secs * 4 + 180)) python3 bench/torch_mp.py --seconds "$secs" "$@" \
		>"$OUT/$label.json" 2>"$OUT/$label.log"
	local rc=$?
	python3 bench/report.py torch "$label" "$OUT/$label.json" "$rc" | tee -a "$OUT/bench.jsonl"
	case $rc in
	0) ;;
	3) echo "   skipped: $(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1]).get("skipped",""))' "$OUT/$label.json" 2>/dev/null)" ;;
	*)
		failed=$((failed + 1))
		echo "   FAILED (exit $rc); last lines of the log:"
		tail -n 5 "$OUT/$label.log" | sed 's/^/   /'
		;;
	esac
}

pairs=("0 0")
[ "$ngpus" -ge 2 ] && pairs+=("0 1")
for pair in "${pairs[@]}"; do
	read -r d c <<<"$pair"
	for v in byte none; do
		ours "cudashare-ring-gpu$d$c-verify-$v" ring $((1 << 20)) "$d" "$c" "$v" -ring 8 -size 1MiB
	done
	# The same with 8 workers: on one GPU each verification is a copy in the
	# consumer's context, which waits for the GPU to switch from the
	# producer's; more copies in flight share a switch.
	row_workers=8 ours "cudashare-ring-gpu$d$c-verify-byte-w8" ring $((1 << 20)) "$d" "$c" byte -ring 8 -size 1MiB
	row_workers=8 ours "cudashare-fresh-gpu$d$c-verify-byte-w8" fresh $((64 << 20)) "$d" "$c" byte -fresh -ring 8 -size 64MiB
	# The handoff alone, against the 300,000/s target: no GPU work, no
	# event, a deeper window and more workers.
	row_workers=4 row_credits=64 ours "cudashare-ring-gpu$d$c-handoff" ring $((1 << 20)) "$d" "$c" none -ring 64 -size 1MiB -fill=false
	row_workers=4 row_credits=64 ours "cudashare-fresh-gpu$d$c-handoff" fresh $((64 << 20)) "$d" "$c" none -fresh -ring 64 -size 64MiB -fill=false
	for v in byte none; do
		ours "cudashare-fresh-gpu$d$c-verify-$v" fresh $((64 << 20)) "$d" "$c" "$v" -fresh -ring 8 -size 64MiB
	done
	torchrow "torch-ring-gpu$d$c" --mode ring --size 1MiB --ring 8 --device "$d" --consumer-device "$c"
	torchrow "torch-fresh-gpu$d$c" --mode fresh --size 64MiB --ring 8 --device "$d" --consumer-device "$c"
done

# The read test: one shared buffer, read whole, against a local one, same GPU.
label=read-test-gpu00
echo "== $label ($read_size)"
timeout -k 10 600 "$BIN/producer" -socket "$sock" -device 0 -ring 1 -size "$read_size" -count 1 \
	-shutdown-timeout 5m -wait 60s -json >"$OUT/$label.producer.json" 2>"$OUT/$label.producer.log" &
ppid=$!
timeout -k 10 600 "$BIN/consumer" -socket "$sock" -device 0 -wait 60s -read-test "$read_size" -json \
	>"$OUT/$label.consumer.json" 2>"$OUT/$label.consumer.log"
cexit=$?
[ "$cexit" != 0 ] && kill -TERM "$ppid" 2>/dev/null
wait "$ppid"
pexit=$?
python3 bench/report.py row "$label" "$OUT/$label.producer.json" "$OUT/$label.consumer.json" "$pexit" "$cexit" \
	device=0 consumer_device=0 |
	tee -a "$OUT/bench.jsonl"
if [ "$pexit" != 0 ] || [ "$cexit" != 0 ]; then
	failed=$((failed + 1))
	tail -n 5 "$OUT/$label.producer.log" "$OUT/$label.consumer.log" | sed 's/^/   /'
fi

python3 bench/report.py table "$OUT/bench.jsonl" >"$OUT/bench.md"
echo
echo "================ gpu-bench: driver $driver, $ngpus GPU(s), ${secs}s per row; logs and bench.jsonl in $OUT ================"
cat "$OUT/env.txt" | sed -n '1p'
echo "command: $cmdline (consumer: -workers $workers -credits 16; producer: -event, one interprocess event per batch)"
echo
cat "$OUT/bench.md"
if [ "$failed" -gt 0 ]; then
	echo "gpu-bench: $failed row(s) FAILED" >&2
	exit 1
fi
