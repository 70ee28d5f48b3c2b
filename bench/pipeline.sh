#!/usr/bin/env bash
# bench/pipeline.sh: a real data pipeline, measured (issue 32). A Go loader
# (examples/loader) decodes JPEGs on the GPU with nvJPEG and lends each
# batch in place to a PyTorch trainer in another process
# (examples/python/train.py: ResNet-50, channels-last, bf16, SGD), against
# the trainer fed by torch's DataLoader (PIL decode, worker processes,
# pinned memory), by torchvision.io.decode_jpeg(device="cuda") in the
# trainer, and by data already on the GPU (the model's limit); and the
# loader alone (its decode rate, no trainer). Every contender runs with 4 and
# with 16 CPU cores (taskset -c 0-3, 0-15; the loader and its trainer share
# the one core set, as the DataLoader trainer and its workers do).
#
# Build here (the GPU machine has no Go), from the repository root:
#
#   CGO_ENABLED=0 go build -ldflags='-s -w' -o .gpu/bin/ ./examples/datagen ./examples/loader
#
# (about 10 MiB; scripts/gpu-test builds more into .gpu/, keep it all under
# 64 MiB). Then on the GPU machine, in ONE device call (about 6 minutes with
# the defaults; every process has its own timeout):
#
#   run(command="bash bench/pipeline.sh", carry=[".gpu"], timeout_s=590)
#
# Flags: -images N (8000: generated there, ~10 s on 16 cores), -batch B (256),
# -seconds S (15: measured per contender, after -warmup 10 steps), -steps N
# (instead of -seconds), -cores "4 16", -bin DIR (.gpu/bin), -data DIR (a data
# set made already: no datagen), -no-mps (leave out the rows of the loader
# and trainer under an MPS daemon of the script's own; without MPS their two
# contexts take turns on the GPU), -mps-cores "4 16" (the core counts of the
# MPS rows: default every one of -cores), -loader-args "..." (added to every
# loader row, e.g. "-lanes 3 -place copy"), -only REGEX (the steps and
# contenders to run, by label: selfcheck, synthetic, loader-alone-nvjpeg,
# loader-alone-cpu, loader+trainer, dataloader, gpudecode,
# loader+trainer+mps; e.g. -only 'selfcheck|loader\+trainer|synthetic' runs
# the selfcheck, the model's limit and the loader with its trainer, with
# and without MPS).
#
# Steps: datagen; loader -selfcheck 64 (nvJPEG against image/jpeg, per
# backend: PASS/FAIL); synthetic; for each core count: the loader alone
# (nvJPEG, and image/jpeg on the cores), loader + trainer, DataLoader with as
# many workers as cores, decode_jpeg in the trainer; then loader + trainer
# under MPS (every -mps-cores count). Writes into $OUT: datagen.json, selfcheck.txt, results.jsonl
# (one line per row: the trainer's and the loader's JSON reports), table.md,
# logs.txt (the end of every process's stderr). Prints the table last.
set -uo pipefail

cd "$(dirname "$0")/.."
images=8000 batch=256 seconds=15 steps=0 warmup=10 cores="4 16" bin=.gpu/bin data= mps=yes only=. mpscores= largs=
while [ $# -gt 0 ]; do
	case $1 in
	-images) images=$2; shift 2 ;;
	-batch) batch=$2; shift 2 ;;
	-seconds) seconds=$2; shift 2 ;;
	-steps) steps=$2; shift 2 ;;
	-warmup) warmup=$2; shift 2 ;;
	-cores) cores=$2; shift 2 ;;
	-bin) bin=$2; shift 2 ;;
	-data) data=$2; shift 2 ;;
	-no-mps) mps=no; shift ;;
	-only) only=$2; shift 2 ;;
	-mps-cores) mpscores=$2; shift 2 ;;
	-loader-args) largs=$2; shift 2 ;;
	-h | -help | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "pipeline: unknown argument $1" >&2; exit 2 ;;
	esac
done
[ -n "$mpscores" ] || mpscores=$cores
read -r -a LARGS <<<"$largs"
OUT=${OUT:-$(mktemp -d /tmp/pipeline-out.XXXXXX)}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/cudashare-pipeline.XXXXXX)
chmod 700 "$work"
mkdir -p "$work/rows" "$work/logs" "$work/s"
chmod 700 "$work/s"
mpsup=no
stop_mps() {
	[ "$mpsup" = yes ] || return 0
	mpsup=no
	echo quit | CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe timeout -k 5 30 nvidia-cuda-mps-control >/dev/null 2>&1 ||
		echo "pipeline: the MPS daemon did not take quit: it may still run" >&2
}
trap 'stop_mps; rm -rf "$work"' EXIT

if [ ! -x "$bin/loader" ] || [ ! -x "$bin/datagen" ]; then
	if command -v go >/dev/null; then
		bin=$work/bin
		CGO_ENABLED=0 go build -o "$bin/" ./examples/datagen ./examples/loader || exit 1
	else
		echo "pipeline: no $bin/loader or $bin/datagen; build them where Go is (see the top of this script) and carry .gpu" >&2
		exit 1
	fi
fi
PY=${PYTHON:-python3}
PYENV=(env "PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}")
if ! timeout 60 "$PY" -c 'import msgpack' 2>/dev/null && [ -d .gpu/pylib/msgpack ]; then
	PYENV=(env "PYTHONPATH=$PWD/python:$PWD/.gpu/pylib${PYTHONPATH:+:$PYTHONPATH}" MSGPACK_PUREPYTHON=1)
fi
ncpu=$(nproc)
trainer_t=$((seconds + ${PIPELINE_TRAINER_SLACK:-150})) # a trainer: import, model, cuDNN autotuning, -seconds, shutdown
[ "$steps" -gt 0 ] && trainer_t=$((steps / 2 + 150))
measure=(--seconds "$seconds" --steps "$steps" --warmup "$warmup" --batch "$batch")
echo "pipeline: $images images, batch $batch, ${seconds}s per contender (steps $steps), cores: $cores of $ncpu; logs in $OUT"
command -v nvidia-smi >/dev/null && timeout -k 5 30 nvidia-smi -L

log() { # log LABEL FILE: the end of a process's stderr into logs.txt
	# (all of it after a hang: its stacks, from SIGQUIT or SIGUSR1 below)
	local n=15
	grep -q "^goroutine \|^Current thread\|^Thread 0x" "$2" 2>/dev/null && n=400
	{ echo "== $1"; tail -n $n "$2"; } >>"$OUT/logs.txt"
}
want() { [[ $1 =~ $only ]]; }
cpuset() { echo "0-$(($1 - 1))"; }

# 1. The data set.
if [ -z "$data" ]; then
	data=$work/ds
	echo "== datagen"
	timeout -k 5 240 "$bin/datagen" -out "$data" -images "$images" -per-shard 250 >"$OUT/datagen.json" 2>"$work/logs/datagen.err"
	rc=$?
	log datagen "$work/logs/datagen.err"
	if [ $rc != 0 ]; then
		echo "pipeline: datagen failed ($rc)" >&2
		cat "$work/logs/datagen.err" >&2
		exit 1
	fi
	cat "$OUT/datagen.json"
fi

# 2. nvJPEG against image/jpeg.
touch "$OUT/selfcheck.txt" "$OUT/results.jsonl"
if want selfcheck; then
	echo "== loader -selfcheck 64"
	timeout -k 5 120 "$bin/loader" -data "$data" -selfcheck 64 >"$OUT/selfcheck.txt" 2>&1
	echo "selfcheck exit $?" >>"$OUT/selfcheck.txt"
	grep '^selfcheck' "$OUT/selfcheck.txt"
fi

# row LABEL CORES: records the JSON reports of a row's processes.
row_json() { # row_json LABEL CORES TRAINER_FILE LOADER_FILE
	"$PY" - "$@" >>"$OUT/results.jsonl" <<'PY'
import json, sys
label, cores, tf, lf = sys.argv[1:5]
def last(p):
    try:
        ls = [l for l in open(p) if l.strip().startswith("{")]
        return json.loads(ls[-1]) if ls else None
    except OSError:
        return None
print(json.dumps({"contender": label, "cores": int(cores), "trainer": last(tf), "loader": last(lf)}))
PY
}

trainer() { # trainer LABEL CORES ARGS...: one trainer alone
	local label=$1 c=$2
	shift 2
	want "$label" || return 0
	echo "== $label, $c cores"
	timeout -k 10 "$trainer_t" taskset -c "$(cpuset "$c")" "${PYENV[@]}" "$PY" examples/python/train.py --data "$data" "${measure[@]}" "$@" \
		>"$work/rows/$label-$c.trainer" 2>"$work/logs/$label-$c.trainer.err"
	local rc=$?
	[ $rc != 0 ] && echo "   trainer exit $rc" | tee -a "$work/logs/$label-$c.trainer.err"
	log "$label $c cores: trainer" "$work/logs/$label-$c.trainer.err"
	row_json "$label" "$c" "$work/rows/$label-$c.trainer" /nonexistent
	tail -n 1 "$work/rows/$label-$c.trainer"
}

alone() { # alone LABEL CORES LOADER_ARGS...: the loader with no consumer
	local label=$1 c=$2
	shift 2
	want "$label" || return 0
	echo "== $label, $c cores"
	timeout -k 5 90 taskset -c "$(cpuset "$c")" "$bin/loader" -data "$data" -consumers 0 -batch "$batch" -duration 8s "${LARGS[@]}" "$@" \
		>"$work/rows/$label-$c.loader" 2>"$work/logs/$label-$c.loader.err"
	log "$label $c cores: loader" "$work/logs/$label-$c.loader.err"
	row_json "$label" "$c" /nonexistent "$work/rows/$label-$c.loader"
	tail -n 1 "$work/rows/$label-$c.loader"
}

pair() { # pair LABEL CORES: the loader and the trainer on one core set
	local label=$1 c=$2
	want "$label" || return 0
	echo "== $label, $c cores"
	local sock=$work/s/loader.sock
	rm -f "$sock"
	# A hang is not silent: at its limit the loader gets SIGQUIT (Go prints
	# every goroutine's stack) and the trainer SIGUSR1 (train.py's
	# faulthandler prints every thread's), each killed 10 s later.
	timeout -s QUIT -k 10 $((trainer_t + 30)) taskset -c "$(cpuset "$c")" "$bin/loader" -data "$data" -socket "$sock" -batch "$batch" \
		-ring 8 -wait 120s "${LARGS[@]}" >"$work/rows/$label-$c.loader" 2>"$work/logs/$label-$c.loader.err" &
	local lpid=$!
	timeout -s USR1 -k 10 "$trainer_t" taskset -c "$(cpuset "$c")" "${PYENV[@]}" "$PY" examples/python/train.py --data "$data" "${measure[@]}" \
		--source cudashare --socket "$sock" --credits 4 >"$work/rows/$label-$c.trainer" 2>"$work/logs/$label-$c.trainer.err"
	local rc=$?
	[ $rc != 0 ] && { echo "   trainer exit $rc" | tee -a "$work/logs/$label-$c.trainer.err"; kill -QUIT $lpid 2>/dev/null; }
	wait $lpid
	local lrc=$?
	[ $lrc != 0 ] && echo "   loader exit $lrc" | tee -a "$work/logs/$label-$c.loader.err"
	log "$label $c cores: loader" "$work/logs/$label-$c.loader.err"
	log "$label $c cores: trainer" "$work/logs/$label-$c.trainer.err"
	row_json "$label" "$c" "$work/rows/$label-$c.trainer" "$work/rows/$label-$c.loader"
	tail -n 1 "$work/rows/$label-$c.trainer"
	tail -n 1 "$work/rows/$label-$c.loader"
}

# 3. The contenders.
trainer synthetic "$ncpu" --source synthetic
for c in $cores; do
	if [ "$c" -gt "$ncpu" ]; then
		echo "pipeline: $c cores asked, this machine has $ncpu: skipped" | tee -a "$OUT/logs.txt"
		continue
	fi
	alone loader-alone-nvjpeg "$c" -decode gpu
	alone loader-alone-cpu "$c" -decode cpu
	pair loader+trainer "$c"
	trainer dataloader "$c" --source dataloader --workers "$c"
	trainer gpudecode "$c" --source gpudecode
done

# 4. The loader and the trainer under MPS.
if [ $mps = yes ] && command -v nvidia-cuda-mps-control >/dev/null && want loader+trainer+mps; then
	mkdir -p "$work/mps/pipe" "$work/mps/log"
	export CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe CUDA_MPS_LOG_DIRECTORY=$work/mps/log
	if nvidia-cuda-mps-control -d >"$work/logs/mps.err" 2>&1; then
		mpsup=yes
		for c in $mpscores; do
			[ "$c" -gt "$ncpu" ] || pair loader+trainer+mps "$c"
		done
		if [ -z "$(echo get_server_list | timeout -k 5 20 nvidia-cuda-mps-control 2>/dev/null | tr -d '[:space:]')" ]; then
			echo "pipeline: the MPS daemon lists no server: the +mps rows ran WITHOUT MPS" | tee -a "$OUT/logs.txt"
		fi
		stop_mps
	else
		echo "pipeline: nvidia-cuda-mps-control -d failed: no MPS rows" | tee -a "$OUT/logs.txt"
		cat "$work/logs/mps.err" >>"$OUT/logs.txt"
	fi
	unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

# 5. The table.
"$PY" - "$OUT/results.jsonl" "$OUT/selfcheck.txt" >"$OUT/table.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def f(v, fmt="%.1f"):
    return "" if v is None else fmt % v
print("| contender | cores | images/s | step ms (mean / p50) | steps waited | trainer CPU s (+ workers) | loader CPU s | notes |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
for r in rows:
    t, l = r.get("trainer") or {}, r.get("loader") or {}
    ips = t.get("images_per_s") if t else l.get("images_per_s")
    notes = []
    if t.get("skipped"): notes.append("skipped: " + t["skipped"])
    if t and not t.get("images"): notes.append("no trainer result (see logs.txt)")
    if t.get("label_errors"): notes.append("%d LABEL ERRORS" % t["label_errors"])
    elif t.get("labels_checked"): notes.append("%d labels checked" % t["labels_checked"])
    if l:
        notes.append("loader: %s decode%s, %.0f img/s, decode %.1fs%s" % (
            l.get("decode"), (" (" + l["backend"] + ")") if l.get("backend") else "", l.get("images_per_s") or 0,
            l.get("decode_s") or 0, (", " + l["error"]) if l.get("error") else ""))
    steps = "%s / %s" % (f(t.get("step_ms_mean")), f(t.get("step_ms_p50"))) if t.get("step_ms_mean") is not None else ""
    waited = f(100 * t["waited_share"], "%.1f%%") if t.get("waited_share") is not None else ""
    tcpu = ""
    if t.get("cpu_s") is not None:
        tcpu = "%.1f" % t["cpu_s"] + (" + %.1f" % t["cpu_children_s"] if t.get("cpu_children_s") else "")
    lcpu = f(l.get("cpu_s")) if l else ""
    print("| %s | %d | %s | %s | %s | %s | %s | %s |" % (r["contender"], r["cores"], f(ips), steps, waited, tcpu, lcpu, "; ".join(notes)))
sc = [l.strip() for l in open(sys.argv[2]) if l.startswith("selfcheck:")]
print()
for l in sc:
    print("- " + l)
PY
echo
cat "$OUT/table.md"
