#!/usr/bin/env bash
# hydra-train run's setup with torch.compile on, this tree against an older one (BASE: a folder
# holding its packages/, extracted as in first_call_ab.sh), in the order ORDER gives: "new:cold"
# runs this tree on fresh inductor and Triton caches and no pretest records ($HYDRA_CACHE_DIR/
# pretests, the machine's first run), "new:warm" on what its cold run left, "new:warmpt" on warm
# caches but pretesting again (--no-reuse_pretests; an older tree has no shared records, so its
# warm and warmpt runs are the same). Every log line is prefixed with the seconds since its process
# started, and dynamo's recompilations are logged (TORCH_LOGS=recompiles); a summary line per run
# gives the step-0 validation's time (all setup before step 1, that evaluation included) and the
# CUDA graph's capture. SCOPE: blocks, model, or none (--no-compile: the baseline to repay).
#
#   source tools/gpu_env.sh
#   BASE=.gl/bench_base SCOPE=blocks STEPS=100 bash packages/hydra-diag/bench/compile_setup_ab.sh
set -u -o pipefail
: "${PYTHONPATH:?source tools/gpu_env.sh first}"
: "${BASE:?BASE must name an extracted older tree}"
BASE=$(cd "$BASE" && pwd) || exit 1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
echo "compile_setup_ab: logs in $OUT"
STEPS=${STEPS:-100}
SCOPE=${SCOPE:-blocks}
LIMIT=${LIMIT:-240}
ORDER=${ORDER:-"new:cold base:cold new:warm"}
ARGS=${ARGS:-}
export HYDRA_CACHE_DIR=${HYDRA_CACHE_DIR:-/tmp/hc}
here=$PYTHONPATH
base="$BASE/packages/hydra-kernels/src:$BASE/packages/hydra-model/src:$BASE/packages/hydra-train/src"
base="$base:$BASE/packages/hydra-diag/src"
stamp='import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    print(f"{time.time() - t0:8.2f} {line}", end="", flush=True)'
for spec in $ORDER; do
  tree=${spec%%:*}
  cache=${spec##*:}
  case "$tree:$cache" in
    new:cold | new:warm | new:warmpt | base:cold | base:warm | base:warmpt) ;;
    *) echo "compile_setup_ab: ORDER entry '$spec': use new|base:cold|warm|warmpt" >&2; exit 2 ;;
  esac
  name=$tree-$cache-$SCOPE
  caches=/tmp/compile-caches-$tree-$SCOPE
  [ "$cache" = cold ] && rm -rf "$caches" "$HYDRA_CACHE_DIR/pretests"
  again=()
  [ "$tree:$cache" = new:warmpt ] && again=(--no-reuse_pretests)
  mkdir -p "$caches"
  pp=$here
  [ "$tree" = base ] && pp=$base
  rm -rf "/tmp/tr/$name"
  compile=(--compile --compile_scope "$SCOPE")
  [ "$SCOPE" = none ] && compile=(--no-compile)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  PYTHONPATH=$pp TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
    TORCH_LOGS=recompiles timeout "$LIMIT" python -W ignore -m hydra_train run \
    --checkpoint_dir "/tmp/tr/$name" --model_size 100M --max_steps "$STEPS" \
    "${compile[@]}" "${again[@]}" $ARGS 2>&1 | python -c "$stamp" "$start" >"$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  end=$(date +%s.%N)
  recompiles=$(grep -c "Recompiling function" "$OUT/$name.log")
  arm=$(grep -o "pretest arm compile: .*" "$OUT/$name.log" | head -n 1)
  first=$(grep -m 1 -E "^ *[0-9.]+ step +[0-9]+/[0-9]+ +loss" "$OUT/$name.log" | awk '{print $1}')
  rate=$(grep -E "step +[0-9]+/[0-9]+ +loss" "$OUT/$name.log" | tail -n 1 | grep -o "[0-9,.]*K\? tok/s")
  setup=$(grep -m 1 -E "^ *[0-9.]+ step +0/[0-9]+ +validation" "$OUT/$name.log" | awk '{print $1}')
  capture=$(grep -m 1 -o "the step captured at step [0-9]* in [0-9.]* s" "$OUT/$name.log")
  reused=$(grep -c "reusing its verdicts" "$OUT/$name.log")
  printf '%s: rc %s, %.1f s in all, %s, step-0 validation at %s s, first logged step at %s s, ' \
    "$name" "$rc" "$(python -c "print($end - $start)")" "${arm:-no compile arm}" "${setup:-?}" \
    "${first:-?}"
  printf '%s, pretests reused %s, last %s, %s recompilations\n' "${capture:-no capture logged}" \
    "$reused" "${rate:-?}" "$recompiles"
done
