#!/usr/bin/env bash
# A single generate call's cost on two trees, alternating: first_call_phases.py run by an older
# tree (BASE: a folder holding its packages/, e.g. extracted on a machine with the repository by
#   git archive <rev> packages | tar -x -C bench_base
# and carried with the working tree) and by this one, ROUNDS times at batch 1 and once at batch 8.
# Alternating processes keeps a drift of the machine from favouring either tree. Writes one
# folder per run under $OUT (its JSON, its log, the tree's name) and prints each run's ratio.
# SCRIPT=single_call_pairs.py runs that script instead (the two models' calls interleaved in each
# process; steadier on a host whose speed drifts), from this tree for both: it needs only
# build_model and generate, which the older tree's packages then provide.
#
#   source tools/gpu_env.sh
#   BASE=bench_base ROUNDS=4 bash packages/hydra-diag/bench/first_call_ab.sh
set -u -o pipefail
OUT=${OUT:-$(mktemp -d)}
BASE=$(cd "${BASE:?BASE must name an extracted older tree}" && pwd)
ROUNDS=${ROUNDS:-4}
SCRIPT=${SCRIPT:-first_call_phases.py}
script=$(cd "$(dirname "$0")" && pwd)/$SCRIPT
here=$PYTHONPATH
base="$BASE/packages/hydra-kernels/src:$BASE/packages/hydra-model/src:$BASE/packages/hydra-train/src"
base="$base:$BASE/packages/hydra-diag/src"
i=0
batches=$(for _ in $(seq "$ROUNDS"); do printf '1 '; done)
for b in $batches 8; do
  for tree in base new; do
    i=$((i + 1))
    pp=$here
    [ "$tree" = base ] && pp=$base
    mkdir -p "$OUT/$i"
    echo "$tree" >"$OUT/$i/tree"
    PYTHONPATH=$pp OUT=$OUT/$i BATCH=$b timeout 120 python -W ignore "$script" >"$OUT/$i/log.txt" 2>&1
    echo "$tree, batch $b: $(tail -n 1 "$OUT/$i/log.txt")"
  done
done
