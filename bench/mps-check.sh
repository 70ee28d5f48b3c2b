#!/usr/bin/env bash
# bench/mps-check.sh: the stream-ordered rows with and without MPS, on one GPU.
# Without MPS the GPU time-slices between the producer's and the consumer's
# contexts, and every batch crosses between them; with an MPS daemon both run
# in one shared context. On the GPU machine, from the repository root, after
# scripts/gpu-test built .gpu/bin here:  bash bench/mps-check.sh
# It starts nvidia-cuda-mps-control as a daemon (a user-space process, no card
# setting) and stops it at the end.
set -u
B=${CUDASHARE_BIN_DIR:-.gpu/bin}; S=/tmp/mpsbench; mkdir -p $S; chmod 700 $S
row() { # name, consumer verify
  timeout 30 $B/producer -socket $S/p.sock -ring 8 -size 1MiB -duration 3s -consumers 1 -json > $S/p.json 2>$S/p.err &
  pp=$!
  timeout 30 $B/consumer -socket $S/p.sock -wait 10s -workers 2 -credits 8 -verify $2 -json > $S/c.json 2>$S/c.err
  wait $pp
  python3 -c "import json;c=json.loads(open('$S/c.json').read().strip().splitlines()[-1]);print('%-28s %8.0f/s p50 %7.1f p99 %8.1f verified %d wrong %d end %s' % ('$1',c['handoffs_per_s'],c['p50_us'],c['p99_us'],c['verified'],c['verify_errors'],c['end']))" || tail -3 $S/c.err
}
row "no MPS, verify byte" byte
row "no MPS, verify async" async
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && sleep 1
  row "MPS, verify byte" byte
  row "MPS, verify async" async
  row "MPS, verify none" none
  echo quit | nvidia-cuda-mps-control
else
  echo "no nvidia-cuda-mps-control on this machine"
fi
