#!/usr/bin/env bash
# The GPU checks of issue 5, one command: the main job as a user runs it (`hydra-train run`, which on
# CUDA picks the 100M preset, bf16 autocast and the stdlib-full corpus) and a 100M run with the
# Triton kernels and chunked cross-entropy. Each prints its summary table (tokens/s, peak memory,
# validation loss first -> final) and writes train_summary_*.json to $OUT; the run folders' small
# artifacts (env.json, mem_boot/mem_step*, heartbeat, fallback counters) are copied to $OUT too.
#
#   bash packages/hydra-diag/bench/gpu_checks.sh
set -euo pipefail
export OUT="${OUT:-$(mktemp -d)}"
work="${HYDRA_GPU_CHECK_DIR:-/tmp/hydra_train_gpu_checks}"
rm -rf "$work"
mkdir -p "$work"
export HYDRA_CACHE_DIR="${HYDRA_CACHE_DIR:-$work/cache}"
export HYDRA_MEM_DUMP_EVERY="${HYDRA_MEM_DUMP_EVERY:-100}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

run() {
  local name=$1
  shift
  echo "=== hydra-train run $* ==="
  python -m hydra_train run --checkpoint_dir "$work/$name" --summary_dir "$OUT" "$@"
  mkdir -p "$OUT/artifacts_$name"
  cp "$work/$name"/runs/*/*.{json,jsonl,txt,csv} "$OUT/artifacts_$name/" 2>/dev/null || true
  python -m hydra_train db stats --checkpoint_dir "$work/$name"
}

run default
run 100m_triton_chunked --model_size 100M --max_steps 300 --triton_kernels --chunked_ce
echo "summaries and artifacts in $OUT"
