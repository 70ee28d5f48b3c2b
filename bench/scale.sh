#!/usr/bin/env bash
# bench/scale.sh: what grows besides consumers (issue 35; README, "Many
# buffers, small buffers"): a producer with 10,000 registered buffers against
# one with 10, a consumer mapping 1,000 allocations (first offer, lookup,
# memory, descriptors; VMM and legacy IPC), and the device memory of 1,000
# buffers of 4 KiB as allocations of their own, a ring or an arena. It runs
# share's benchmarks BenchmarkRegistered10000, BenchmarkConsumerMaps1000 and
# BenchmarkSmallBuffers from a test binary (each benchmark re-runs the
# binary as its consumer process). On the GPU machine, from the repository
# root, after scripts/gpu-test has built .gpu/share.test:
#
#   bash bench/scale.sh [-bin .gpu/share.test] [-offers N] [-driver cuda|sim|auto]
#   (device tool: run(command="bash bench/scale.sh", carry=[".gpu"]))
#
# -offers is the offers of the repeated part (-test.benchtime Nx) of the first
# two benchmarks (default 20000); the third makes and frees its 1,000 buffers
# 3 times a row. -driver defaults to cuda where nvidia-smi runs, else auto
# (the simulator without a GPU). Here, without a GPU:
#
#   go test -c -o /tmp/share.test ./share && bash bench/scale.sh -bin /tmp/share.test
#
# Logs go to $OUT (or a temporary directory); the benchmark lines to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."

bin=.gpu/share.test
offers=20000
drv=
while [ $# -gt 0 ]; do
	case $1 in
	-bin) bin=$2; shift 2 ;;
	-offers) offers=$2; shift 2 ;;
	-driver) drv=$2; shift 2 ;;
	-h | -help | --help) sed -n '2,23p' "$0"; exit 0 ;;
	*) echo "scale.sh: unknown argument: $1" >&2; exit 2 ;;
	esac
done
if [ -z "$drv" ]; then
	if nvidia-smi -L >/dev/null 2>&1; then drv=cuda; else drv=auto; fi
fi
[ -x "$bin" ] || { echo "scale.sh: no test binary at $bin (scripts/gpu-test builds .gpu/share.test)" >&2; exit 2; }
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
OUT=${OUT:-$(mktemp -d /tmp/scale.XXXXXX)}
mkdir -p "$OUT"
export CUDASHARE_DRIVER=$drv
[ "$drv" = auto ] && unset CUDASHARE_DRIVER

rc=0
run() { # name benchtime regex
	local log="$OUT/$1.log"
	echo "== $1: share.test -test.run '^\$' -test.bench '$3' -test.benchtime $2 -test.benchmem (driver $drv)"
	(cd share && timeout 590 "$bin" -test.run '^$' -test.bench "$3" -test.benchtime "$2" -test.benchmem -test.timeout 9m) >"$log" 2>&1
	local r=$?
	grep -E '^tests on backend' "$log"
	grep -E '^Benchmark|^(--- )?(FAIL|SKIP)|^ok|^PASS|: the simulated machine holds' "$log" | grep -v '^--- BENCH'
	if [ $r -ne 0 ]; then
		echo "scale.sh: $1 failed (exit $r); last lines of $log:"
		tail -n 20 "$log"
		rc=1
	fi
}
run many "${offers}x" 'Registered10000|ConsumerMaps1000'
run small 3x 'SmallBuffers'
echo "logs: $OUT"
exit $rc
