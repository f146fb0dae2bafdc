#!/usr/bin/env bash
# Issue 13's single-GPU figures in one call: setup of the 100M preset's graphed training step on a
# cold compile cache and again on the warm one (each a fresh process), then the 500M and 1B presets
# (tokens/s, memory, MFU on executed FLOPs). Each run is by default bench_model.py's `graph` mode:
# the whole step captured as a CUDA graph, the routing glue compiled, fused kernels, chunked CE:
# the path hydra-train takes on CUDA for a run too short to compile (hydra_train.config.
# compile_by_default). Steps are bounded by what is left of DEADLINE seconds; the JSON of each run
# goes to $OUT. SETUP=0 skips the two setup runs; PEER=1 times the dense GPT of each size after
# HYDRA's (bench_model.py's `compile` mode, the whole model compiled); both take 0 or 1.
# HYDRA_ARGS replaces HYDRA's run arguments (default: the graphed step, `--configs dynamic --modes
# graph`), PEER_ARGS the GPT's (words split on spaces).
#
#   source tools/gpu_env.sh
#   DEADLINE=520 bash packages/hydra-diag/bench/speed_gpu.sh
#   SETUP=0 PEER=1 SIZES=250M,500M,1B bash packages/hydra-diag/bench/speed_gpu.sh
#   SETUP=0 SIZES=100M,500M,1B HYDRA_ARGS="--configs dynamic --modes compile+graph --compile-scope model" \
#     bash packages/hydra-diag/bench/speed_gpu.sh
set -u -o pipefail
OUT=${OUT:-$(mktemp -d)}
DEADLINE=${DEADLINE:-520}
SIZES=${SIZES:-500M,1B}
SETUP=${SETUP:-1}
PEER=${PEER:-0}
for flag in SETUP PEER; do
  [[ ${!flag} == [01] ]] || { echo "speed_gpu.sh: $flag=${!flag}: use 0 or 1" >&2; exit 2; }
done
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
    --warmup 1 "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$? $name $(($(date +%s) - start)) s" | tee -a "$OUT/status"
  grep -E "tok/s|FAILED" "$OUT/$name.log" | tail -3
}

read -r -a hydra <<<"${HYDRA_ARGS:---configs dynamic --modes graph}"
read -r -a peer <<<"${PEER_ARGS:---configs gpt --modes compile --compile-scope model}"
if ((SETUP)); then
  step setup_cold 200 "${hydra[@]}" --model-size 100M --steps 10
  step setup_warm 150 "${hydra[@]}" --model-size 100M --steps 10
fi
for size in ${SIZES//,/ }; do
  step "size_$size" 240 "${hydra[@]}" --model-size "$size" --steps 6
  if ((PEER)); then
    step "gpt_$size" 240 "${peer[@]}" --model-size "$size" --steps 6
  fi
done
cat "$OUT/status"
