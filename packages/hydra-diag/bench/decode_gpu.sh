#!/usr/bin/env bash
# Generation on one GPU, in one call: the CUDA tests of graphed decoding and of the conditional-node
# probe, then `hydra-diag bench inference` for the GPT and HYDRA with every decode mode that can win
# at batch 1 (eager, graphs: one graph with conditional nodes or a graph per segment, masked: one
# plain graph), at batch 1 and 8. Each step is bounded by what is left of DEADLINE seconds; outputs
# (logs, inference_b*.json) go to $OUT.
#
#   source tools/gpu_env.sh
#   DEADLINE=300 bash packages/hydra-diag/bench/decode_gpu.sh
#
# A dry run on a CPU: DEVICE=cpu SIZE=tiny FLOPS_SEQ=256 MODES=eager,staged,masked bash .../decode_gpu.sh
set -u -o pipefail
OUT=${OUT:-$(mktemp -d)}
DEADLINE=${DEADLINE:-300}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-100M}
MODES=${MODES:-eager,graphs,masked}
FLOPS_SEQ=${FLOPS_SEQ:-2048}
mkdir -p "$OUT"
t0=$(date +%s)

step() {  # step NAME MAX_SECONDS COMMAND...: runs COMMAND under what is left of DEADLINE
  local name=$1 limit=$2 left
  shift 2
  left=$((DEADLINE - ($(date +%s) - t0)))
  if ((left < 15)); then
    echo "skipped $name: no time left" | tee -a "$OUT/status"
    return
  fi
  ((limit > left)) && limit=$left
  local start
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$? $name $(($(date +%s) - start)) s" | tee -a "$OUT/status"
}

step tests 120 python -m pytest -q -p no:cacheprovider -W ignore \
  tests/hydra_model/test_decode_graphs.py tests/hydra_model/test_conditional_graphs.py \
  tests/hydra_model/test_decode_kernels.py tests/hydra_model/test_fused_decide.py
for batch in 1 8; do
  step "inference_b$batch" 120 sh -c "python -W ignore -m hydra_diag bench inference --model_size $SIZE \
    --configs gpt,hydra --decode $MODES --batch_size $batch --device $DEVICE --flops_seq_len $FLOPS_SEQ --json \
    > $OUT/inference_b$batch.json"
done
# CCGQA's decode convs as one GEMM over the token's window (HYDRA_DECODE_CONV, hydra_model.options)
step inference_b1_window_gemm 90 env HYDRA_DECODE_CONV=window_gemm sh -c "python -W ignore -m hydra_diag \
  bench inference --model_size $SIZE --configs gpt,hydra --decode $MODES --device $DEVICE \
  --flops_seq_len $FLOPS_SEQ --json > $OUT/inference_b1_window_gemm.json"
python - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("inference_b*.json")):
    try:
        rows = json.loads(path.read_text())["rows"]
    except (ValueError, KeyError):
        print(f"{path.name}: no result")
        continue
    for r in rows:
        d = r["decode_report"]
        print(f"{path.stem} {r['config']:<6} {d['mode']:<7} {str(d['capture']):<12} "
              f"{r['tokens_per_s']:9.1f} tok/s  run/skipped {d['gated_run']}/{d['gated_skipped']}"
              f"  agree {r['tokens_agree_with_first_mode']:.3f}  {d['reason'] or ''}")
PY
cat "$OUT/status"
