#!/usr/bin/env bash
# bench/gomaxprocs-check.sh: the handoff alone (-fill=false, -verify none) with
# GOMAXPROCS unset, 1, 2 and 4 in both processes, ring 8/credits 8/1 worker and
# ring 64/credits 64/4 workers, 3 s each. On the GPU machine, from the
# repository root, after scripts/gpu-test built .gpu/bin here.
set -u
B=${CUDASHARE_BIN_DIR:-.gpu/bin}; S=/tmp/gmpbench; mkdir -p $S; chmod 700 $S
row() { # gomaxprocs (empty: default), ring, credits, workers
  GOMAXPROCS=$1 timeout 30 $B/producer -socket $S/p.sock -ring $2 -size 1MiB -fill=false -duration 3s -consumers 1 -json > $S/p.json 2>$S/p.err &
  pp=$!
  GOMAXPROCS=$1 timeout 30 $B/consumer -socket $S/p.sock -wait 10s -workers $4 -credits $3 -verify none -json > $S/c.json 2>$S/c.err
  wait $pp
  python3 -c "import json;c=json.loads(open('$S/c.json').read().strip().splitlines()[-1]);print('GOMAXPROCS=%-8s ring %-3s credits %-3s workers %s: %8.0f/s p50 %6.1f p99 %7.1f' % ('${1:-default}','$2','$3','$4',c['handoffs_per_s'],c['p50_us'],c['p99_us']))" || tail -3 $S/c.err
}
for g in "" 1 2 4; do row "$g" 8 8 1; row "$g" 64 64 4; done
