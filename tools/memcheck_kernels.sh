#!/usr/bin/env bash
# compute-sanitizer's memcheck over hydra-kernels' tests, on a GPU machine, from the repository
# root after `source tools/gpu_env.sh`:
#   bash tools/memcheck_kernels.sh [OUT_DIR] [TEST_FILE ...]
# Every tensor is its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so that an access past a
# tensor's end is caught rather than landing in the caching allocator's next block. That also
# refuses CUDA-graph capture (no cudaMalloc while capturing): the capture tests fail under it and
# their reports say "operation not permitted when stream is capturing", which is not a kernel's
# fault. What counts is a line "Invalid __global__ read/write" or "Misaligned". One log per file;
# nine files run at once; MC_TIMEOUT (default 150) seconds each.
set -u
out=${1:-memcheck}
shift || true
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(tests/hydra_kernels/test_*.py)
mkdir -p "$out"
one() {
  local f=$1 out=$2 name
  name=$(basename "$f" .py)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MC_TIMEOUT:-150}" compute-sanitizer --tool memcheck \
    --print-limit 5 --error-exitcode 99 python -m pytest -q -p no:cacheprovider "$f" > "$out/$name.log" 2>&1
  local rc=$?
  local bad
  bad=$(grep -c "Invalid __global__\|Invalid __shared__\|Misaligned" "$out/$name.log")
  echo "$name rc=$rc invalid_accesses=$bad $(grep -E '[0-9]+ (passed|failed)' "$out/$name.log" | tail -1)"
}
export -f one
printf '%s\n' "${files[@]}" | xargs -P 9 -I{} bash -c 'one "$1" "$2"' _ {} "$out"
