#!/usr/bin/env bash
# The race campaign on one machine with two GPUs (or, for a dry run, the CPU): the corpus once,
# then two lanes, one per GPU, each a list of `hydra-diag race run` calls with its own JSON.
# Every configuration runs alone on its GPU; the two lanes run side by side on identical GPUs.
#
#   source tools/gpu_env.sh
#   setsid nohup bash packages/hydra-diag/bench/race_campaign.sh > /tmp/race/campaign.log 2>&1 &
#
# Settings (environment): RACE_DIR (/tmp/race), SIZE (100M), SHORT (120) and LONG (600) budgets
# in seconds, EXTRA (extra `race run` options, e.g. for a CPU dry run: "--device cpu
# --seq_len 64 --batch_size 2 --val_windows 4"), LANE0 / LANE1 (space-separated
# CONFIG:BUDGET items; `inference` runs `bench inference` on that lane's GPU; LANE1= (empty) on a
# one-GPU machine), MIN_EPOCH_S (the
# training split must last at least this many seconds at 520K tokens/s, else the source
# extensions below are added), CORPUS (options naming other source trees, e.g. for a dry run
# "--corpus_root /some/small/tree"), EXTENSIONS (build the corpus from these file types at once,
# without first trying .py alone), WAIT_FOR (a file the lanes wait for after the corpus is built,
# so that other GPU work of the same call can finish before the first timed step).
set -u -o pipefail
RACE_DIR=${RACE_DIR:-/tmp/race}
SIZE=${SIZE:-100M}
SHORT=${SHORT:-120}
LONG=${LONG:-600}
EXTRA=${EXTRA:-}
CORPUS=${CORPUS:-}
MIN_EPOCH_S=${MIN_EPOCH_S:-660}
WIDE_EXT=${WIDE_EXT:-py,pyi,c,h,cc,cpp,hpp,cu,cuh,md,rst,txt}
LANE0=${LANE0-"gpt:$SHORT gpt:$LONG inference hydra-no-mod:$SHORT gpt-ccgqa:$SHORT hydra-expert-choice:$SHORT"}
LANE1=${LANE1-"hydra:$SHORT hydra:$LONG hydra-no-mor:$SHORT hydra-routing-off:$SHORT hydra-v1:$SHORT"}
mkdir -p "$RACE_DIR"
stamp() { date -u +%H:%M:%S; }

EXTENSIONS=${EXTENSIONS:-}
EXT_OPT=""
epoch=""
if [ -n "$EXTENSIONS" ]; then
  echo "[$(stamp)] corpus ($EXTENSIONS)"
  # shellcheck disable=SC2086
  python3 -m hydra_diag race corpus --tokens_per_s 520000 --extensions "$EXTENSIONS" $CORPUS 2>&1 \
    | tee "$RACE_DIR/corpus.log" || { echo "[$(stamp)] the corpus could not be built: no race"; exit 1; }
  EXT_OPT="--extensions $EXTENSIONS"
else
  echo "[$(stamp)] corpus (py)"
  # shellcheck disable=SC2086
  python3 -m hydra_diag race corpus --tokens_per_s 520000 $CORPUS 2>&1 | tee "$RACE_DIR/corpus-py.log" \
    || { echo "[$(stamp)] the corpus could not be built: no race"; exit 1; }
  epoch=$(sed -n 's/.*one epoch of the training split = \([0-9]*\) s.*/\1/p' "$RACE_DIR/corpus-py.log" | tail -1)
fi
if [ -n "$epoch" ] && [ "$epoch" -lt "$MIN_EPOCH_S" ]; then
  echo "[$(stamp)] one epoch = ${epoch} s < ${MIN_EPOCH_S} s: adding $WIDE_EXT"
  # shellcheck disable=SC2086
  python3 -m hydra_diag race corpus --tokens_per_s 520000 --extensions "$WIDE_EXT" $CORPUS 2>&1 \
    | tee "$RACE_DIR/corpus-wide.log" || { echo "[$(stamp)] the wider corpus failed: no race"; exit 1; }
  EXT_OPT="--extensions $WIDE_EXT"
fi
echo "$EXT_OPT" > "$RACE_DIR/extensions.txt"
if [ -n "${WAIT_FOR:-}" ]; then
  echo "[$(stamp)] waiting for $WAIT_FOR"
  while [ ! -e "$WAIT_FOR" ]; do sleep 2; done
fi

lane() {  # lane GPU ITEMS...
  local gpu=$1; shift
  for item in "$@"; do
    if [ "$item" = inference ]; then
      echo "[$(stamp)] gpu$gpu inference"
      CUDA_VISIBLE_DEVICES=$gpu python3 -m hydra_diag bench inference --model_size "$SIZE" \
        --configs gpt,hydra --json > "$RACE_DIR/inference.json" 2> "$RACE_DIR/inference.log"
      continue
    fi
    local cfg=${item%%:*} budget=${item##*:}
    local name="race${budget}-${cfg}"
    echo "[$(stamp)] gpu$gpu $name"
    # shellcheck disable=SC2086  # EXTRA and EXT_OPT are option lists
    CUDA_VISIBLE_DEVICES=$gpu python3 -m hydra_diag race run --configs "$cfg" --model_size "$SIZE" \
      --budget "$budget" $EXT_OPT $CORPUS $EXTRA --json "$RACE_DIR/$name.json" --plots "$RACE_DIR/$name" \
      > "$RACE_DIR/$name.log" 2>&1
    echo "[$(stamp)] gpu$gpu $name exit $?"
  done
}

# shellcheck disable=SC2086  # the lanes are word lists
lane 0 $LANE0 &
lane 1 $LANE1 &
wait
echo "[$(stamp)] campaign done"
