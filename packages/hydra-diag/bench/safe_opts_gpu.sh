#!/usr/bin/env bash
# SafeOptimizations on one CUDA GPU: the GPU-only checks (FP8 GEMMs, bitsandbytes state
# conversion), then `hydra-train pretest --all` per model size, then OPTIMIZATIONS.md from the logs.
#
#   source tools/gpu_env.sh                                        # packages + peer wheels (.whl)
#   bash packages/hydra-diag/bench/safe_opts_gpu.sh [SIZE ...]    # default: 100M 250M 500M 1B
#
# Pretest logs accumulate in packages/hydra-diag/bench/pretest_logs (override: SAFE_OPTS_LOGS);
# the report is rebuilt from all of them, so sizes can be run in separate calls. Settings per size
# (batch x sequence; 2 untimed + 4 timed steps per arm) are printed in the report's first table.
# Everything lands in $OUT too: the checks' JSON, one console log per size, the report, the logs.
set -uo pipefail
OUT=${OUT:-/tmp/safe_opts_out}
mkdir -p "$OUT"
LOGS=${SAFE_OPTS_LOGS:-packages/hydra-diag/bench/pretest_logs}
PER_SIZE_TIMEOUT=${PER_SIZE_TIMEOUT:-280}
ARM_TIMEOUT=${ARM_TIMEOUT:-90}  # one optimization's arm, compilation included
export PYTHONUNBUFFERED=1
sizes=("$@")
[ ${#sizes[@]} -eq 0 ] && sizes=(100M 250M 500M 1B)

if [ -z "${SKIP_CHECKS:-}" ]; then
  python3 packages/hydra-diag/bench/safe_opts_gpu_checks.py 2>&1 | tee "$OUT/gpu_checks.txt"
fi
for size in "${sizes[@]}"; do
  case $size in
    100M) shape="--batch_size 8 --seq_len 1024" ;;
    250M) shape="--batch_size 8 --seq_len 512" ;;
    *) shape="--batch_size 4 --seq_len 512" ;;
  esac
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$PER_SIZE_TIMEOUT" python3 -m hydra_train pretest --all --model_size "$size" $shape \
    --log_dir "$LOGS" --pretest_warmup_steps 2 --pretest_steps 4 --pretest_arm_timeout "$ARM_TIMEOUT" \
    2>&1 | tee "$OUT/pretest_$size.txt"
  echo "== $size: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pretest_$size.txt"
done
python3 -m hydra_train pretest --report packages/hydra-train/OPTIMIZATIONS.md --log_dir "$LOGS"
cp packages/hydra-train/OPTIMIZATIONS.md "$OUT/" 2>/dev/null
tar czf "$OUT/pretest_logs.tgz" -C "$LOGS" . 2>/dev/null
python3 -m hydra_train pretest --history --log_dir "$LOGS"
