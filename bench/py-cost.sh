#!/usr/bin/env bash
# bench/py-cost.sh: the Python consumer's cost per lease (issue 33's targets),
# one GPU, one call: bench/py_lease_cost.py against the Go example producer,
# each row alone and with --group (Consumer.next_many / release_many), beside
# the hand-written CuPy channel (bench/cupy_ipc.py) and torch.multiprocessing
# (bench/torch_mp.py) of the same run. About 2 minutes.
#
#   bash bench/py-cost.sh [-seconds S] [-group N]
#   (device tool: run(command="bash bench/py-cost.sh", carry=[".gpu"]))
#
# Rows:
#   handoff  producer -fill=false (no GPU work, no event): py_lease_cost.py
#            --mode host and --mode release: next + release alone, the
#            package's own time; cupy_ipc.py --no-fill: the CuPy channel's
#            handoff alone. Target: cudashare >= 1.3x CuPy's leases/s, and
#            next + release <= 8 us per lease (with --group if need be).
#   op       producer with fill and event: --mode op and --mode array (a
#            torch op per batch), beside torch_mp.py (fill + .item()).
# Each py_lease_cost.py line: mode, leases/s, us per lease of next,
# __dlpack__, from_dlpack, op, del, release, and thread-cpu (the consumer
# thread's CPU time per lease). MPS rows: bench/mps-check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
secs=3
group=4
while [ $# -gt 0 ]; do
	case $1 in
	-seconds) secs=$2; shift 2 ;;
	-group) group=$2; shift 2 ;;
	*) echo "py-cost: unknown argument $1" >&2; exit 2 ;;
	esac
done
BIN=${CUDASHARE_BIN_DIR:-.gpu/bin}
PY=${PYTHON:-python3}
PYENV=(env "PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}")
if ! timeout 60 "$PY" -c 'import msgpack' 2>/dev/null; then
	if [ -z "${PYTHON:-}" ] && timeout 60 /usr/bin/python3 -c 'import msgpack, torch' 2>/dev/null; then
		PY=/usr/bin/python3
	elif [ -d .gpu/pylib/msgpack ]; then
		# Pure-Python msgpack: the rows then measure it too (say so with them).
		echo "py-cost: WARNING: $PY has no msgpack; using .gpu/pylib's pure-Python one: next costs more" >&2
		PYENV=(env "PYTHONPATH=$PWD/python:$PWD/.gpu/pylib${PYTHONPATH:+:$PYTHONPATH}" MSGPACK_PUREPYTHON=1)
	fi
fi
work=$(mktemp -d /tmp/cudashare-pycost.XXXXXX)
chmod 700 "$work" # the producer refuses a socket directory others can write
trap 'rm -rf "$work"' EXIT
sock=$work/s
echo "py-cost: $PY, producer $BIN/producer, $secs s per row, groups of $group"
command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi -L

lease_cost() { # FILL MODE [GROUP]
	local fill=$1 mode=$2 g=${3:-}
	timeout -k 5 60 "$BIN/producer" -socket "$sock" -sharing vmm -ring 8 -size 1MiB -fill="$fill" -event="$fill" \
		-duration "${secs}s" -wait 30s >"$work/p.out" 2>"$work/p.err" &
	local pp=$!
	timeout -k 5 60 "${PYENV[@]}" "$PY" bench/py_lease_cost.py --socket "$sock" --mode "$mode" --wait 30 \
		${g:+--group "$g"} >"$work/c.out" 2>&1
	local cexit=$?
	sed "s/^/fill=$fill  /" "$work/c.out"
	[ "$cexit" = 0 ] || kill -TERM "$pp" 2>/dev/null # a consumer that failed or skipped takes no batch
	wait "$pp" || [ "$cexit" != 0 ] || { echo "   producer failed:"; tail -n 3 "$work/p.err"; }
}

echo "== the handoff alone (producer -fill=false)"
for m in host release; do
	lease_cost false "$m"
	lease_cost false "$m" "$group"
done
echo "== CuPy by hand, the handoff alone"
timeout -k 5 90 "$PY" bench/cupy_ipc.py --seconds "$secs" --ring 8 --size 1MiB --no-fill
echo "== a torch op per batch (producer with fill and event)"
for m in op array; do
	lease_cost true "$m"
	lease_cost true "$m" "$group"
done
echo "== torch.multiprocessing, fill + .item()"
timeout -k 5 90 "$PY" bench/torch_mp.py --mode ring --size 1MiB --ring 8 --seconds "$secs"
echo "== CuPy by hand, fill + event, --verify none"
timeout -k 5 90 "$PY" bench/cupy_ipc.py --seconds "$secs" --ring 8 --size 1MiB
