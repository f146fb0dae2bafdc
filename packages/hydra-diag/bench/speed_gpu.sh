#!/usr/bin/env bash
# Issue 13's single-GPU figures in one call: setup of the 100M preset's graphed training step on a
# cold compile cache and again on the warm one (each a fresh process), then the 500M and 1B presets
# (tokens/s, memory, MFU on executed FLOPs). Each run is bench_model.py's `graph` mode: the whole
# step captured as a CUDA graph, the routing glue compiled, fused kernels, chunked CE: the path
# hydra-train takes on CUDA by default. Steps are bounded by what is left of DEADLINE seconds;
# the JSON of each run goes to $OUT.
#
#   source tools/gpu_env.sh
#   DEADLINE=520 bash packages/hydra-diag/bench/speed_gpu.sh
set -u -o pipefail
OUT=${OUT:-$(mktemp -d)}
DEADLINE=${DEADLINE:-520}
SIZES=${SIZES:-500M,1B}
mkdir -p "$OUT"
t0=$(date +%s)
caches=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton

step() {  # step NAME MAX_SECONDS ARGS...: bench_model.py ARGS under what is left of DEADLINE
  local name=$1 limit=$2 left
  shift 2
  left=$((DEADLINE - ($(date +%s) - t0)))
  if ((left < 30)); then
    echo "skipped $name: no time left" | tee -a "$OUT/status"
    return
  fi
  ((limit > left)) && limit=$left
  local start
  start=$(date +%s)
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" timeout -k 5 "$limit" python -W ignore packages/hydra-diag/bench/bench_model.py \
    --configs dynamic --modes graph --warmup 1 "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$? $name $(($(date +%s) - start)) s" | tee -a "$OUT/status"
  grep -E "tok/s|FAILED" "$OUT/$name.log" | tail -3
}

step setup_cold 200 --model-size 100M --steps 10
step setup_warm 150 --model-size 100M --steps 10
for size in ${SIZES//,/ }; do
  step "size_$size" 150 --model-size "$size" --steps 6
done
cat "$OUT/status"
