#!/usr/bin/env bash
# Issue 13 item 4, "multi-GPU at single-GPU speed", in one call of at most ~540 s on a 2-GPU machine:
# per-GPU steady-state tokens/s of `hydra-train run` (100M preset, the defaults: 16 x 1024 tokens per
# GPU, bf16, fused kernels, chunked CE, SafeOptimizations with their pretests) on
#   1gpu         one GPU, CUDA graphs (the single-GPU fast path)
#   ddp_graphed  torchrun --nproc_per_node 2, the default: DDP steps CUDA-graphed, gradients averaged
#                by the hand-rolled all-reduce inside the graph (--ddp_grad_sync auto)
#   ddp_eager    torchrun --nproc_per_node 2 --no-experimental_cuda_graphs: plain eager DDP (the
#                earlier 67K tokens/s per GPU), run only when enough of the budget is left
#   fsdp         torchrun --nproc_per_node 2 --fsdp: FSDP2, eager steps (not graphed)
#   fsdp_compile torchrun --nproc_per_node 2 --fsdp --compile: FSDP2 with each block compiled
# Each run trains STEPS steps (CUDA graphs captured after WARMUP eager steps); "steady" is the median
# tokens/s of the log intervals in the second half of the run, per GPU (hydra-train logs tokens/s
# over all ranks). The target: ddp_graphed per GPU >= 90% of 1gpu. Written to $OUT: each run's
# console log, train_summary_*.json, pretest logs, and ddp_gpu.json with the table printed at the end.
#
#   source tools/gpu_env.sh
#   bash packages/hydra-diag/bench/ddp_gpu.sh
#
# EXTRA_ARGS are added to every run, words split on spaces (e.g. EXTRA_ARGS=--compile: the three
# with torch.compile).
#
# CPU dry run of the script itself (tiny model, gloo, a generated token file; no speed measured):
#   HYDRA_BENCH_CPU=1 PYTHON=python bash packages/hydra-diag/bench/ddp_gpu.sh
set -u -o pipefail
OUT=${OUT:-$(mktemp -d)}
BUDGET=${BUDGET:-530}  # seconds for the whole call
STEPS=${STEPS:-240}
WARMUP=${WARMUP:-30}
LOG_EVERY=${LOG_EVERY:-20}
PYTHON=${PYTHON:-python3}
RUNS=${RUNS:-1gpu,ddp_graphed,ddp_eager}  # which of the three runs below
read -r -a extra <<<"${EXTRA_ARGS:-}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent machines (see the device notes); keep it so in every rank
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
work=${HYDRA_DDP_BENCH_DIR:-/tmp/hydra_ddp_bench}
rm -rf "$work"
mkdir -p "$work" "$OUT"
export HYDRA_CACHE_DIR=${HYDRA_CACHE_DIR:-$work/cache}
t0=$(date +%s)

common=(--max_steps "$STEPS" --cuda_graphs_warmup "$WARMUP" --log_every "$LOG_EVERY" --eval_every 100000
  --eval_batches 2 --save_every 0)
if [ -n "${HYDRA_BENCH_CPU:-}" ]; then
  # a learnable-enough token file, so that the CPU run needs no corpus or tokenizer
  "$PYTHON" - "$work/data" <<'PY'
import sys
import numpy as np
from hydra_train.shards import write_token_shard
rng = np.random.default_rng(0)
for split, n in (("train", 20000), ("val", 4000)):
    write_token_shard(f"{sys.argv[1]}/{split}/part0.bin", rng.integers(1, 320, size=n))
PY
  common=(--device cpu --cpu_threads 1 --model_size tiny --model_override dim=64 --model_override max_seq_len=64
    --dataset "$work/data" --vocab_size 320 --seq_len 32 --batch_size 2 --max_steps 8 --log_every 2
    --eval_every 100000 --eval_batches 1 --save_every 0)
  new_mode=(--ddp_grad_sync allreduce)  # on the CPU auto means DDP's reducer (no graphs there)
else
  common=(--model_size 100M "${common[@]}")
  new_mode=()  # the default: what a user gets
fi

run() {  # run NAME NPROC MAX_SECONDS ARGS...
  local name=$1 nproc=$2 limit=$3 left start rc
  shift 3
  [[ ",$RUNS," == *",$name,"* ]] || return 0
  left=$((BUDGET - ($(date +%s) - t0)))
  if ((left < 60)); then
    echo "== $name skipped: ${left} s of the budget left" | tee -a "$OUT/status"
    return
  fi
  ((limit > left)) && limit=$left
  local launch=("$PYTHON" -m hydra_train)
  if ((nproc > 1)); then
    launch=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m hydra_train)
  fi
  echo "== $name: ${launch[*]} run ${common[*]} $* (limit ${limit} s)"
  start=$(date +%s)
  mkdir -p "$OUT/$name"
  timeout -k 10 "$limit" "${launch[@]}" run --checkpoint_dir "$work/$name" --summary_dir "$OUT/$name" \
    --json "${common[@]}" "${extra[@]}" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $(($(date +%s) - start)) s" | tee -a "$OUT/status"
  grep -E "SafeOptimizations status|pretest (cuda_graphs|compile)|cuda_graphs disabled|Error|error:" "$OUT/$name.log" | tail -6
  cp -r "$work/$name/pretest_logs" "$OUT/$name/" 2>/dev/null || true
}

CUDA_VISIBLE_DEVICES=0 run 1gpu 1 170  # one of the two GPUs
run ddp_graphed 2 210 "${new_mode[@]}"
run ddp_eager 2 170 --no-experimental_cuda_graphs
run fsdp 2 170 --fsdp
run fsdp_compile 2 210 --fsdp --compile

"$PYTHON" - "$work" "$OUT" <<'PY'
import glob, json, sqlite3, statistics, sys
work, out = sys.argv[1], sys.argv[2]
rows = []
for name, nproc in (("1gpu", 1), ("ddp_graphed", 2), ("ddp_eager", 2), ("fsdp", 2), ("fsdp_compile", 2)):
    summ = sorted(glob.glob(f"{out}/{name}/train_summary_*.json"))
    s = json.load(open(summ[-1])) if summ else {}
    steps = []
    try:
        con = sqlite3.connect(f"file:{work}/{name}/training.db?mode=ro", uri=True)
        steps = con.execute("SELECT step, tokens_per_s FROM steps ORDER BY step").fetchall()
    except sqlite3.Error:
        pass
    last = max((st for st, _ in steps), default=0)
    late = [tps / nproc for st, tps in steps if st > last / 2 and tps]
    rows.append({
        "run": name, "gpus": nproc, "status": s.get("status", "missing"), "steps": s.get("steps"),
        "per_gpu_steady": statistics.median(late) if late else None,
        "per_gpu_mean": s["tokens_per_s"] / nproc if s.get("tokens_per_s") else None,
        "cuda_graphs": (s.get("safe_opts") or {}).get("cuda_graphs"),
        "cuda_graphs_reason": (s.get("safe_opts_reasons") or {}).get("cuda_graphs"),
        "grad_sync": s.get("grad_sync"), "memory_mb": s.get("memory_mb"),
        "safe_opts": s.get("safe_opts"), "safe_opts_reasons": s.get("safe_opts_reasons"),
    })
base = rows[0]["per_gpu_steady"]
for r in rows:
    r["vs_1gpu"] = r["per_gpu_steady"] / base if base and r["per_gpu_steady"] else None
json.dump(rows, open(f"{out}/ddp_gpu.json", "w"), indent=2)
def fmt(v, spec):
    return "-" if v is None else format(v, spec)
print(f"{'run':<12} {'status':<9} {'tok/s/GPU steady':>16} {'mean':>9} {'vs 1gpu':>8}  cuda_graphs, gradients")
for r in rows:
    print(f"{r['run']:<12} {r['status']:<9} {fmt(r['per_gpu_steady'], ',.0f'):>16} "
          f"{fmt(r['per_gpu_mean'], ',.0f'):>9} {fmt(r['vs_1gpu'], '.1%'):>8}  {r['cuda_graphs']}, "
          f"{r['grad_sync']}" + (f" ({r['cuda_graphs_reason']})" if r["cuda_graphs_reason"] else ""))
PY
echo "total $(($(date +%s) - t0)) s; everything in $OUT"
