#!/usr/bin/env bash
# bench/final-check.sh: one device call that checks a landing on the GPU
# machine, each step under its own timeout: the test suites with the real
# driver (.gpu/run.sh), `cudashare devices`, the fan-out rows with the
# consumers spread over the GPUs and every producer to every GPU, `cudashare
# top` against a producer whose consumers sit on every GPU, what top and a
# metrics scrape cost, and the loader with its trainer on 4 cores. Build here
# first (CGO_ENABLED=0): scripts/gpu-test ./transport/ ./share/ ./integration/
# ./pool/ ./driver/ ./metrics/, then go build -ldflags='-s -w' -o .gpu/bin/
# ./examples/datagen ./examples/loader. Small results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${OUT:-$(mktemp -d)}
export OUT=$R
step() { echo; echo "=== $*"; }

step devices
timeout -k 5 30 .gpu/bin/cudashare devices 2>&1 | tee "$R/devices.txt"

step suites
OUT=/tmp/suites timeout -k 10 ${SUITES_T:-240} .gpu/run.sh -timeout 3m >/tmp/suites.out 2>&1
echo "suites rc=$?"
sed -n '/==== summary/,$p' /tmp/suites.out | head -60 | tee "$R/suites.txt"
grep -h "reconnect_test.go:" /tmp/suites/*.log 2>/dev/null | tail -8 | tee -a "$R/suites.txt"

step fan-out spread and mesh
OUT=/tmp/fo timeout -k 5 120 bash bench/fanout.sh -seconds 2 -spread -n "${SPREAD_N:-1 4 16}" -broadcast-n "8" 2>&1 | grep "^|" | tee "$R/fanout-spread.md"

step top
D=$(mktemp -d); chmod 700 "$D"; S=$D/s.sock # the producer refuses a socket directory others can enter
n=$(nvidia-smi -L | grep -c '^GPU')
timeout -k 5 40 .gpu/bin/producer -socket $S -duration 12s -consumers $((2 * n)) -ring 64 -size 1MiB >/tmp/top-producer.out 2>&1 &
pp=$!
for i in $(seq 0 $((2 * n - 1))); do
	timeout -k 5 40 .gpu/bin/consumer -socket $S -device $((i % n)) -wait 20s -verify none -credits 8 >/dev/null 2>&1 &
done
sleep 5
timeout -k 5 10 .gpu/bin/cudashare top -once -interval 1s $S 2>&1 | tee "$R/top.txt"
timeout -k 5 10 .gpu/bin/cudashare top -once -json $S 2>/dev/null | head -c 3000 > "$R/top.json"
wait

step top-cost
OUT=/tmp/tc timeout -k 5 ${TOPCOST_T:-100} bash bench/top-cost.sh -seconds ${TOPCOST_S:-3} -reps ${TOPCOST_REPS:-2} 2>&1 | tail -12 | tee "$R/top-cost.txt"

step pipeline 4 cores
PIPELINE_TRAINER_SLACK=60 OUT=/tmp/pl timeout -k 10 ${PIPE_T:-160} bash bench/pipeline.sh -images 2000 -seconds 8 -cores 4 -no-mps -only 'loader\+trainer' 2>&1 | grep "^|" | tee "$R/pipeline.md"
grep -A40 "goroutine \|Current thread\|Thread 0x" /tmp/pl/logs.txt 2>/dev/null | head -80 > "$R/pipeline-stacks.txt"

if [ -n "${PYCOST:-}" ]; then
	step python cost per lease
	timeout -k 5 ${PYCOST_T:-150} bash bench/py-cost.sh -seconds ${PYCOST_S:-2} 2>&1 | tee "$R/py-cost.txt" | tail -40
fi
