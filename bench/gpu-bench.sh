#!/usr/bin/env bash
# bench/gpu-bench.sh: cudashare's handoff benchmark, every row in one run, each
# against the floor (a bare Unix socket), the limit (the same GPU work in one
# process) and torch.multiprocessing. On the GPU machine, from the repository
# root, after scripts/gpu-test has built the binaries into .gpu/bin here:
#
#   bash bench/gpu-bench.sh [-seconds N] [-read-size SIZE] [-workers N]
#                           [-rows REGEX] [-sharing "ipc vmm"] [-no-costs] [-no-mps]
#   (with the device tool: run(command="bash bench/gpu-bench.sh -seconds 3", carry=[".gpu"]))
#
# Rows, each run for about -seconds (default 5); "same GPU" rows, then with
# two GPUs the same with the consumer (stream C) on GPU 1:
#   floor      bench/floor: two Go processes, a bare Unix socket, 96 B out and
#              16 B back per message; one in flight, and windows of 8 and 64.
#   limit      bench/limit: one process, a ring of 8 buffers (1 MiB, 64 MiB),
#              stream P fills and records, stream C waits (and with "copy"
#              copies the buffer to a scratch buffer) and records, P waits
#              before refilling; no IPC, no host wait per batch.
#   cudashare  the example producer and consumer, each row twice, producer
#              -sharing ipc (legacy CUDA IPC) and -sharing vmm (VMM
#              allocations sent as fds), labels ending -ipc and -vmm: the
#              handoff alone (-fill=false, -verify none) with credits 1/1
#              worker, 8/1, 8/2, ring 64 credits 64 4 workers and 1, and fresh
#              64 MiB from an arena, the messages through the shm
#              channel (the default), and credits 1, 8 and ring 64 again with
#              the producer's -shm=false (labels with -socket): the messages
#              on the socket; then a fill and an interprocess event per
#              batch with -verify none, byte and async (stream-ordered copy
#              and release; skipped with a note if the consumer has no such
#              mode), ring of 8 x 1 MiB and fresh 64 MiB, -workers (default
#              2), credits 8; and -verify async on a ring of 32 x 1 MiB,
#              credits 32, with the producer's -group 16 (batches filled and
#              offered 16 at a time); on one GPU a ring of 128 in groups of
#              64 too, and across GPUs the ring of 8 with 4 workers.
#   python     the Python consumer (python/, msgpack; PYTHONPATH .gpu/pylib
#              if the python3 here lacks it) against the Go producer, ring of
#              8 x 1 MiB, both sharing paths: python -m cudashare consume
#              with the handoff alone; bench/py_consumer.py with torch work
#              per batch (a tensor of the lease, a sum of 16 bytes into a
#              device accumulator on the lease's stream, stream-ordered
#              release, checked at the end), skipped where torch or a GPU is
#              missing; each on the socket (the Python consumer's
#              default), then with --shm true (labels with -shm): the
#              messages through the shm channel.
#   cupy       bench/cupy_ipc.py: raw IPC handles over a multiprocessing Pipe,
#              a hand-written open cache, 8 in flight: the handoff alone, then
#              fill + interprocess event with and without a one-byte readback.
#   torch      bench/torch_mp.py: torch.multiprocessing, fill + .item(), ring
#              of 8 x 1 MiB and fresh 64 MiB, 8 in flight.
#   costs      bench/vmmcost: alloc, export, open in another process, close,
#              free, for both paths (8 MiB: a ring's allocation; 512 MiB: an
#              arena's), and the first offer (Dial to first lease) of a ring
#              and an arena (-no-costs leaves them out).
#   mps        on the real driver, where nvidia-cuda-mps-control is, the one-GPU
#              rows whose two processes both queue GPU work again under an MPS
#              daemon of the benchmark's own (labels ending -mps before the
#              sharing path): the limits, -verify byte and async on the ring
#              of 8, torch.multiprocessing and the Python consumer with torch.
#              Without MPS the two processes' contexts take turns on the GPU;
#              under MPS they share it. The daemon has a private pipe
#              directory (these rows do not use a daemon the machine already
#              runs, nor stop it), is quit at the end and changes no setting
#              of the GPU; a client is first checked to get an MPS server (one
#              that cannot reach the daemon runs without MPS, silently), else
#              one skipped row says why. -no-mps leaves these rows out.
#   read test  a consumer copies a whole shared buffer (default 1 GiB) against
#              a local one on the same GPU.
# -rows REGEX runs only the rows whose label matches (bash =~, e.g.
# 'ring-gpu00-(handoff-c8|verify)|torch|python'); -sharing "vmm" runs the
# cudashare and python rows for one path only.
# One failing row does not stop the others; every process has a timeout.
# JSON lines go to $OUT/bench.jsonl, logs to $OUT/*.log, the markdown table
# (bench/report.py) to $OUT/bench.md, printed last, with IPC and VMM side by
# side. Exit 1 if any row failed (a skipped row is not a failure).
# About 6.5 minutes at -seconds 2 on two GPUs (107 rows, 9 of them under
# MPS, and the costs).
#
# Without a GPU (or with CUDASHARE_DRIVER=sim) it runs on the simulated driver, with
# -seconds 2 and a 64 MiB read test unless told otherwise, so that its plumbing
# is tested anywhere; CuPy and torch rows are skipped where they are missing.
set -uo pipefail

cd "$(dirname "$0")/.."
cmdline="bash bench/gpu-bench.sh${*:+ $*}"
secs= read_size= workers=2 rows= sharings="ipc vmm" costs=yes mps=yes
while [ $# -gt 0 ]; do
	case $1 in
	-seconds) secs=$2; shift 2 ;;
	-rows) rows=$2; shift 2 ;;
	-sharing) sharings=$2; shift 2 ;;
	-no-costs) costs=no; shift ;;
	-no-mps) mps=no; shift ;;
	-read-size) read_size=$2; shift 2 ;;
	-workers) workers=$2; shift 2 ;;
	-h | -help | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
	*) echo "gpu-bench: unknown argument $1 (-h for help)" >&2; exit 2 ;;
	esac
done

OUT=${OUT:-$(mktemp -d /tmp/gpu-bench.XXXXXX)}
mkdir -p "$OUT"
: >"$OUT/bench.jsonl"
work=$(mktemp -d /tmp/cudashare-bench.XXXXXX) # mode 0700: the socket's directory
mpsup=no
# stop_mps quits the MPS daemon this script started, if it did.
stop_mps() {
	[ "$mpsup" = yes ] || return 0
	mpsup=no
	if ! echo quit | CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe timeout -k 5 30 nvidia-cuda-mps-control >/dev/null 2>&1; then
		echo "gpu-bench: the MPS daemon did not take quit (pipe directory $work/mps/pipe): it may still run" >&2
	fi
}
trap 'stop_mps; rm -rf "$work"' EXIT

# The binaries: CUDASHARE_BIN_DIR, else .gpu/bin, else built here if Go is.
BIN=${CUDASHARE_BIN_DIR:-.gpu/bin}
progs=(producer consumer cudashare floor limit vmmcost)
missing=()
for p in "${progs[@]}"; do [ -x "$BIN/$p" ] || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
	if command -v go >/dev/null; then
		echo "gpu-bench: $BIN lacks ${missing[*]}: building the binaries into $work/bin"
		BIN=$work/bin
		CGO_ENABLED=0 go build -o "$BIN/" ./examples/producer ./examples/consumer ./cmd/cudashare ./bench/floor ./bench/limit ./bench/vmmcost || exit 1
	else
		echo "gpu-bench: $BIN lacks ${missing[*]}; run scripts/gpu-test where Go is, and carry .gpu" >&2
		exit 1
	fi
fi
if ! command -v python3 >/dev/null; then
	echo "gpu-bench: python3 is needed for CuPy, torch and the table" >&2
	exit 1
fi
# The Python consumer needs msgpack: the python3 here, else the pure-Python
# copy scripts/gpu-test puts in .gpu/pylib. PYCS is the environment of its rows.
PYCS=(env "PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}")
if ! python3 -c 'import msgpack' 2>/dev/null && [ -d .gpu/pylib/msgpack ]; then
	PYCS=(env "PYTHONPATH=$PWD/python:$PWD/.gpu/pylib${PYTHONPATH:+:$PYTHONPATH}" MSGPACK_PUREPYTHON=1)
fi
pymsgpack=yes
"${PYCS[@]}" python3 -c 'import msgpack' 2>/dev/null || pymsgpack=no

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
# Does the consumer have -verify async (stream-ordered release)?
async=no
"$BIN/consumer" -h 2>&1 | grep -A3 -e '^  -verify' | grep -qw async && async=yes
# Does the producer have -group (batches taken, filled and offered together)?
group=no
"$BIN/producer" -h 2>&1 | grep -qe '^  -group' && group=yes
{
	echo "command: $cmdline"
	echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) gpu-bench: driver $driver, $ngpus GPU(s), ${secs}s per row, read test $read_size, consumer -verify async: $async"
	cat "$OUT/devices.txt"
	command -v nvidia-smi >/dev/null && nvidia-smi -L
	[ -f .gpu/run.sh ] && grep -m1 '^BUILT=' .gpu/run.sh
	# The host's shape: rows of hosts of different shapes are not
	# comparable (the ring of 8 across GPUs made 382k/s on one host with
	# two H200s and 711k-848k/s on another; bench/RESULTS.md).
	echo "host: $(nproc) CPUs ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p')), NUMA nodes: $(lscpu 2>/dev/null | sed -n 's/^NUMA node(s): *//p')"
	command -v nvidia-smi >/dev/null && nvidia-smi topo -m 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep -E '^GPU[0-9]' | sed 's/^/topology: /'
} | tee "$OUT/env.txt"

failed=0
sock=$work/bench.sock
# runmeta: KEY=VALUE pairs every row's JSON line gets (mps=true under MPS).
runmeta=()
# want LABEL: is the row selected by -rows?
want() { [ -z "$rows" ] || [[ $1 =~ $rows ]]; }
# report ...: bench/report.py appends the row's JSON line to bench.jsonl and
# prints a short line.
report() { python3 bench/report.py "$@" >>"$OUT/bench.jsonl"; }
skip() { # skip LABEL REASON KEY=VALUE...
	local label=$1 why=$2
	shift 2
	echo "== $label"
	report skip "$label" "$why" "$@"
}
fail_tail() { # fail_tail WHAT LOG...
	local what=$1
	shift
	failed=$((failed + 1))
	echo "   FAILED ($what); last lines of the logs:"
	tail -n 5 "$@" | sed 's/^/   /'
}

# tool LABEL KEY=VALUE... -- COMMAND...: a row that prints one JSON line
# (floor, limit, CuPy, torch); exit 3 means skipped.
tool() {
	local label=$1
	shift
	local meta=()
	while [ "$1" != -- ]; do meta+=("$1"); shift; done
	shift
	want "$label" || return 0
	echo "== $label"
	timeout -k 10 $((secs * 4 + 180)) "$@" >"$OUT/$label.json" 2>"$OUT/$label.log"
	local rc=$?
	report tool "$label" "$OUT/$label.json" "$rc" "${meta[@]}" "${runmeta[@]}"
	case $rc in
	0 | 3) ;; # 3: skipped, and report said why
	*) fail_tail "exit $rc" "$OUT/$label.log" ;;
	esac
}

# ours LABEL DEVICE CONSUMER_DEVICE WORKERS CREDITS VERIFY WORK -- PRODUCER_ARGS...
# WORK is the GPU work per batch, for the limit it is compared with: none,
# fill (the producer's memset), fill+copy (and the consumer's copy). Runs the
# row once per sharing path (-sharing), labelled LABEL-ipc and LABEL-vmm.
ours() {
	local label=$1 dev=$2 cdev=$3 w=$4 cr=$5 verify=$6 gwork=$7
	shift 8
	local sh
	for sh in $sharings; do
		pair "$label-$sh" "$dev" "$cdev" "$gwork" "$cr" "$sh" go verify="$verify" workers="$w" credits="$cr" -- \
			"$BIN/consumer" -socket "$sock" -device "$cdev" -wait 60s -verify "$verify" -workers "$w" -credits "$cr" -json \
			-- "$@"
	done
}

# pair LABEL DEVICE CONSUMER_DEVICE WORK CREDITS SHARING CONSUMER_IMPL KEY=VALUE... -- CONSUMER... -- PRODUCER_ARGS...
# runs the example producer (-sharing SHARING) and a consumer command, each
# with a timeout; a consumer that fails or is skipped (exit 3) ends the
# producer.
pair() {
	local label=$1 dev=$2 cdev=$3 gwork=$4 cr=$5 sh=$6 cimpl=$7
	shift 7
	want "$label" || return 0
	local meta=("${runmeta[@]}") ccmd=()
	while [ "$1" != -- ]; do meta+=("$1"); shift; done
	shift
	while [ "$1" != -- ]; do ccmd+=("$1"); shift; done
	shift
	local ring inflight
	ring=$(python3 -c 'import sys; a=sys.argv[1:]; print(a[a.index("-ring")+1])' "$@")
	inflight=$((cr < ring ? cr : ring))
	echo "== $label"
	local limit=$((secs * 2 + 120))
	timeout -k 10 "$limit" "$BIN/producer" -socket "$sock" -device "$dev" -duration "${secs}s" -sharing "$sh" \
		-consumers 1 -wait 60s -json "$@" >"$OUT/$label.producer.json" 2>"$OUT/$label.producer.log" &
	local ppid=$!
	timeout -k 10 "$limit" "${ccmd[@]}" >"$OUT/$label.consumer.json" 2>"$OUT/$label.consumer.log"
	local cexit=$?
	# A consumer that failed leaves the producer waiting for it: end it
	# (timeout passes the signal on; the producer shuts down gracefully).
	[ "$cexit" != 0 ] && kill -TERM "$ppid" 2>/dev/null
	wait "$ppid"
	local pexit=$?
	if [ "$cexit" = 3 ] && grep -q '"skipped"' "$OUT/$label.consumer.json" 2>/dev/null; then
		report skip "$label" "$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["skipped"])' "$OUT/$label.consumer.json" 2>/dev/null || echo "consumer exit 3")" \
			impl="$cimpl" sharing="$sh" device="$dev" consumer_device="$cdev" in_flight="$inflight" gpu_work="$gwork" "${meta[@]}"
		return 0
	fi
	report row "$label" "$OUT/$label.producer.json" "$OUT/$label.consumer.json" "$pexit" "$cexit" \
		device="$dev" consumer_device="$cdev" in_flight="$inflight" gpu_work="$gwork" sharing="$sh" consumer="$cimpl" "${meta[@]}"
	if [ "$pexit" != 0 ] || [ "$cexit" != 0 ]; then
		fail_tail "producer exit $pexit, consumer exit $cexit" "$OUT/$label.producer.log" "$OUT/$label.consumer.log"
	fi
}

# torch_ring LABEL DEVICE CONSUMER_DEVICE: torch.multiprocessing, ring of 8 x 1 MiB.
torch_ring() {
	tool "$1" in_flight=8 gpu_work=fill -- python3 bench/torch_mp.py --seconds "$secs" --mode ring --size 1MiB --ring 8 --device "$2" --consumer-device "$3"
}

# py_torch LABEL DEVICE CONSUMER_DEVICE SHARING [SHM]: the Python consumer
# with torch work per batch and stream-ordered release (bench/py_consumer.py);
# SHM true: its messages through the shm channel.
py_torch() {
	local label=$1 d=$2 c=$3 sh=$4 shm=${5:-false}
	if [ $pymsgpack = no ]; then
		want "$label" && skip "$label" "no msgpack for python3" impl=cudashare-python+torch sharing="$sh" mode=ring ring=8 size=$MiB \
			device="$d" consumer_device="$c" in_flight=8 gpu_work=fill+torch "${runmeta[@]}"
		return 0
	fi
	pair "$label" "$d" "$c" fill+torch 8 "$sh" python+torch impl=cudashare-python+torch workers=1 credits=8 -- \
		"${PYCS[@]}" python3 bench/py_consumer.py --socket "$sock" --device "$c" --wait 60 --credits 8 --work sum \
		--shm "$shm" -- -ring 8 -size 1MiB
}

# The floor: no GPU, so once.
for win in 1 8 64; do
	tool "floor-window$win" -- "$BIN/floor" -window "$win" -seconds "$secs" -json
done

pairs=("0 0")
[ "$ngpus" -ge 2 ] && pairs+=("0 1")
MiB=$((1 << 20))
for pair in "${pairs[@]}"; do
	read -r d c <<<"$pair"
	g=gpu$d$c
	# The limit: the same GPU work in one process, no IPC.
	for sz in 1MiB 64MiB; do
		tool "limit-$g-fill-$sz" -- "$BIN/limit" -device "$d" -consumer-device "$c" -ring 8 -size "$sz" -copy=false -seconds "$secs" -json
		tool "limit-$g-copy-$sz" -- "$BIN/limit" -device "$d" -consumer-device "$c" -ring 8 -size "$sz" -copy=true -seconds "$secs" -json
	done

	# The handoff alone: no GPU work, no event, no verification.
	ours "cudashare-ring-$g-handoff-c1-w1" "$d" "$c" 1 1 none none -- -ring 8 -size 1MiB -fill=false
	ours "cudashare-ring-$g-handoff-c8-w1" "$d" "$c" 1 8 none none -- -ring 8 -size 1MiB -fill=false
	ours "cudashare-ring-$g-handoff-c8-w2" "$d" "$c" 2 8 none none -- -ring 8 -size 1MiB -fill=false
	ours "cudashare-ring64-$g-handoff-c64-w4" "$d" "$c" 4 64 none none -- -ring 64 -size 1MiB -fill=false
	# With no work per batch, 4 workers contend for the importer's lock
	# (bench/RESULTS.md): the same ring with 1.
	ours "cudashare-ring64-$g-handoff-c64-w1" "$d" "$c" 1 64 none none -- -ring 64 -size 1MiB -fill=false
	ours "cudashare-fresh-$g-handoff-c64-w4" "$d" "$c" 4 64 none none -- -fresh -ring 64 -size 64MiB -fill=false
	# The same with the messages on the socket, for comparison: the
	# producer does not offer the shm channel.
	if "$BIN/producer" -h 2>&1 | grep -qe '^  -shm'; then
		ours "cudashare-ring-$g-handoff-c1-w1-socket" "$d" "$c" 1 1 none none -- -ring 8 -size 1MiB -fill=false -shm=false
		ours "cudashare-ring-$g-handoff-c8-w1-socket" "$d" "$c" 1 8 none none -- -ring 8 -size 1MiB -fill=false -shm=false
		ours "cudashare-ring64-$g-handoff-c64-w4-socket" "$d" "$c" 4 64 none none -- -ring 64 -size 1MiB -fill=false -shm=false
	fi

	# A fill and an interprocess event per batch.
	for mode in ring fresh; do
		if [ $mode = ring ]; then pargs=(-ring 8 -size 1MiB); else pargs=(-fresh -ring 8 -size 64MiB); fi
		ours "cudashare-$mode-$g-verify-none" "$d" "$c" "$workers" 8 none fill -- "${pargs[@]}"
		ours "cudashare-$mode-$g-verify-byte" "$d" "$c" "$workers" 8 byte fill -- "${pargs[@]}"
		if [ $async = yes ]; then
			ours "cudashare-$mode-$g-verify-async" "$d" "$c" "$workers" 8 async fill+copy -- "${pargs[@]}"
			if [ $mode = ring ] && [ $group = yes ]; then
				# On one GPU without MPS the two processes' GPU work
				# time-slices: groups of 16 switch once per group.
				ours "cudashare-ring32-$g-verify-async-g16" "$d" "$c" "$workers" 32 async fill+copy -- -ring 32 -group 16 -size 1MiB
				# Bigger groups switch less often, for latency: on one
				# GPU a ring of 128 in groups of 64.
				if [ "$d" = "$c" ]; then
					ours "cudashare-ring128-$g-verify-async-g64" "$d" "$c" "$workers" 128 async fill+copy -- -ring 128 -group 64 -size 1MiB
				fi
			fi
			if [ $mode = ring ] && [ "$d" != "$c" ] && [ "$workers" -lt 4 ]; then
				# Across GPUs the bound is the GPU's chain of
				# interprocess events on each worker's stream, not the
				# host: more workers are more streams.
				ours "cudashare-ring-$g-verify-async-w4" "$d" "$c" 4 8 async fill+copy -- -ring 8 -size 1MiB
			fi
		else
			sz=$MiB
			[ $mode = fresh ] && sz=$((64 * MiB))
			for sh in $sharings; do
				want "cudashare-$mode-$g-verify-async-$sh" || continue
				skip "cudashare-$mode-$g-verify-async-$sh" "the consumer has no -verify async yet (stream-ordered copy and release): not in \`consumer -h\`" \
					impl=cudashare mode=$mode size=$sz ring=8 device="$d" consumer_device="$c" verify=async workers="$workers" \
					credits=8 in_flight=8 gpu_work=fill+copy fill=true sharing="$sh"
			done
		fi
	done

	# Raw CUDA IPC by hand, and torch.multiprocessing.
	tool "cupy-ring-$g-handoff" in_flight=8 -- python3 bench/cupy_ipc.py --seconds "$secs" --ring 8 --size 1MiB \
		--no-fill --device "$d" --consumer-device "$c"
	for v in none byte; do
		tool "cupy-ring-$g-verify-$v" in_flight=8 -- python3 bench/cupy_ipc.py --seconds "$secs" --ring 8 --size 1MiB \
			--verify "$v" --device "$d" --consumer-device "$c"
	done
	torch_ring "torch-ring-$g" "$d" "$c"
	tool "torch-fresh-$g" in_flight=8 gpu_work=fill -- python3 bench/torch_mp.py --seconds "$secs" --mode fresh --size 64MiB --ring 8 --device "$d" --consumer-device "$c"

	# The Python consumer (python/), ring of 8 x 1 MiB, credits 8, both paths:
	# the handoff alone through python -m cudashare consume, then torch work
	# per batch with stream-ordered release (bench/py_consumer.py); each with
	# the messages on the socket (the default), then through the
	# shm channel (--shm true, labels with -shm).
	for sh in $sharings; do
		for shm in false true; do
			sfx=; [ $shm = true ] && sfx=-shm
			label="python-ring-$g-handoff$sfx-$sh"
			if [ $pymsgpack = no ]; then
				want "$label" && skip "$label" "no msgpack for python3 (Debian: python3-msgpack; or carry .gpu/pylib from scripts/gpu-test)" \
					impl=cudashare-python sharing="$sh" device="$d" consumer_device="$c" in_flight=8 gpu_work=none mode=ring ring=8 size=$MiB
			else
				pair "$label" "$d" "$c" none 8 "$sh" python impl=cudashare-python verify=none workers=1 credits=8 -- \
					"${PYCS[@]}" python3 -m cudashare consume --socket "$sock" --device "$c" --wait 60 --verify none \
					--workers 1 --credits 8 --shm $shm -- -ring 8 -size 1MiB -fill=false
			fi
			py_torch "python-ring-$g-torch$sfx-$sh" "$d" "$c" "$sh" $shm
		done
	done
done

# The costs of each sharing path (bench/vmmcost): same GPU, then across GPUs.
if [ $costs = yes ]; then
	for pair in "${pairs[@]}"; do
		read -r d c <<<"$pair"
		label=costs-gpu$d$c
		want "$label" || continue
		echo "== $label"
		timeout -k 10 240 "$BIN/vmmcost" -device "$d" -consumer-device "$c" -paths "${sharings// /,}" \
			-timeout 200s >"$OUT/$label.jsonl" 2>"$OUT/$label.log"
		rc=$?
		python3 bench/report.py costs "$label" "$OUT/$label.jsonl" "$rc" >>"$OUT/bench.jsonl"
		[ $rc = 0 ] || fail_tail "exit $rc" "$OUT/$label.log"
	done
fi

# Under MPS: the one-GPU rows whose two processes both queue GPU work. Without
# MPS the GPU runs one process's context at a time, and each batch crosses from
# the producer's to the consumer's and back (bench/RESULTS.md: 12k-16k/s with a
# copy per batch, where one process does 115k-124k); an MPS daemon runs both
# processes' work in one context. What a user with one GPU would run.
mpsrows=(limit-gpu00-fill-1MiB-mps limit-gpu00-copy-1MiB-mps torch-ring-gpu00-mps)
for sh in $sharings; do
	mpsrows+=("cudashare-ring-gpu00-verify-byte-mps-$sh" "python-ring-gpu00-torch-mps-$sh")
	[ $async = yes ] && mpsrows+=("cudashare-ring-gpu00-verify-async-mps-$sh")
done
mpswant=no
for l in "${mpsrows[@]}"; do want "$l" && mpswant=yes; done

# start_mps starts an MPS daemon with a private pipe directory and checks
# that a CUDA client gets an MPS server: a client that cannot reach the
# daemon runs without MPS, saying nothing, and its rows would be labelled
# wrongly. If not, it sets mpswhy and returns 1 (the caller stops the daemon).
mpswhy=
start_mps() {
	local env=(env "CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe" "CUDA_MPS_LOG_DIRECTORY=$work/mps/log")
	mkdir -p "$work/mps/pipe" "$work/mps/log"
	if ! "${env[@]}" nvidia-cuda-mps-control -d >"$OUT/mps-start.log" 2>&1; then
		mpswhy="nvidia-cuda-mps-control -d failed ($(tail -n 1 "$OUT/mps-start.log"); another daemon in charge of the GPUs, or a compute mode that forbids it?)"
		return 1
	fi
	mpsup=yes
	# The daemon starts a server when a client makes its first context.
	if ! "${env[@]}" timeout -k 5 60 "$BIN/limit" -device 0 -consumer-device 0 -ring 8 -size 1MiB -copy=false -seconds 1 -json \
		>"$OUT/mps-probe.log" 2>&1; then
		mpswhy="a CUDA client under the daemon failed ($(tail -n 1 "$OUT/mps-probe.log"))"
		return 1
	fi
	if [ -z "$(echo get_server_list | "${env[@]}" timeout -k 5 20 nvidia-cuda-mps-control 2>/dev/null | tr -d '[:space:]')" ]; then
		mpswhy="a CUDA client ran, but the daemon lists no MPS server: the client ran without MPS"
		return 1
	fi
}

if [ $mps = yes ] && [ $mpswant = yes ]; then
	if [ "$driver" != cuda ]; then
		skip mps-gpu00 "the $driver driver: MPS rows need the real driver" device=0 consumer_device=0
	elif ! command -v nvidia-cuda-mps-control >/dev/null; then
		skip mps-gpu00 "no nvidia-cuda-mps-control on this machine" device=0 consumer_device=0
	else
		echo "== MPS: starting a daemon of our own (pipe directory $work/mps/pipe)"
		if start_mps; then
			# The environment the rows run in; what the user had is put back.
			had_pipe=${CUDA_MPS_PIPE_DIRECTORY+x} old_pipe=${CUDA_MPS_PIPE_DIRECTORY-}
			had_log=${CUDA_MPS_LOG_DIRECTORY+x} old_log=${CUDA_MPS_LOG_DIRECTORY-}
			export CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe CUDA_MPS_LOG_DIRECTORY=$work/mps/log
			runmeta=(mps=true)
			tool limit-gpu00-fill-1MiB-mps -- "$BIN/limit" -device 0 -consumer-device 0 -ring 8 -size 1MiB -copy=false -seconds "$secs" -json
			tool limit-gpu00-copy-1MiB-mps -- "$BIN/limit" -device 0 -consumer-device 0 -ring 8 -size 1MiB -copy=true -seconds "$secs" -json
			ours cudashare-ring-gpu00-verify-byte-mps 0 0 "$workers" 8 byte fill -- -ring 8 -size 1MiB
			if [ $async = yes ]; then
				ours cudashare-ring-gpu00-verify-async-mps 0 0 "$workers" 8 async fill+copy -- -ring 8 -size 1MiB
			fi
			torch_ring torch-ring-gpu00-mps 0 0
			for sh in $sharings; do
				py_torch "python-ring-gpu00-torch-mps-$sh" 0 0 "$sh"
			done
			runmeta=()
			unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
			[ -n "$had_pipe" ] && export CUDA_MPS_PIPE_DIRECTORY=$old_pipe
			[ -n "$had_log" ] && export CUDA_MPS_LOG_DIRECTORY=$old_log
		else
			skip mps-gpu00 "$mpswhy (logs: mps-*.log)" device=0 consumer_device=0
		fi
		stop_mps
		for f in "$work"/mps/log/*.log; do [ -f "$f" ] && cp "$f" "$OUT/mps-${f##*/}"; done
	fi
fi

if [ "$ngpus" -lt 2 ] && want across-gpus; then
	skip across-gpus "one GPU: the rows with the consumer on a second GPU (limit, cudashare, CuPy, torch) need two" device=0 consumer_device=1
fi

# The read test: one shared buffer, read whole, against a local one, same GPU.
label=read-test-gpu00
if want "$label"; then
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
report row "$label" "$OUT/$label.producer.json" "$OUT/$label.consumer.json" "$pexit" "$cexit" device=0 consumer_device=0
if [ "$pexit" != 0 ] || [ "$cexit" != 0 ]; then
	fail_tail "producer exit $pexit, consumer exit $cexit" "$OUT/$label.producer.log" "$OUT/$label.consumer.log"
fi
fi

python3 bench/report.py table "$OUT/bench.jsonl" "$OUT/env.txt" >"$OUT/bench.md"
echo
echo "================ gpu-bench: driver $driver, $ngpus GPU(s), ${secs}s per row; logs and bench.jsonl in $OUT ================"
echo
cat "$OUT/bench.md"
if [ "$failed" -gt 0 ]; then
	echo "gpu-bench: $failed row(s) FAILED" >&2
	exit 1
fi
