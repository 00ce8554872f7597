#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py or pretrain_hybrid.py (core_v0.19.0 + patches/, copied to a temporary folder)
# with 2D context parallelism on 4 CPU ranks under torchrun: the commands tests/test_pretrain_gpt_cpu.py and
# tests/test_pretrain_hybrid_cpu.py run on forked ranks.
#   bash tools/pretrain_gpt_cpu.sh                  # 4 ranks, CP=4 as hp x cp = 2 x 2, window 2
#   CP=1 bash tools/pretrain_gpt_cpu.sh             # the CP=1 reference (unpatched script, 1 rank)
#   bash tools/pretrain_gpt_cpu.sh --print-flags    # the pretrain_gpt flags, one a line
#   ENTRY=hybrid [PATTERN='M*-M*-'] bash tools/pretrain_gpt_cpu.sh   # pretrain_hybrid.py: Mamba + 2D attention
#     (CPU stand-ins for the Mamba/GDN kernels; the CP=1 reference runs Megatron's local hybrid spec)
#   STOCK_CP=a2a+p2p [TE_RELEASE=2.20.2] bash tools/pretrain_gpt_cpu.sh   # stock Megatron CP instead of 2D: the
#     unpatched pretrain_gpt.py, --bf16, megatron-core's TEDotProductAttention over Transformer Engine's own
#     context_parallel.py (megatron_2d_dev.stock_cp_spec); STOCK_CP=p2p | a2a | a2a+p2p (hierarchical 2 x CP/2)
#     | all_gather
# Needs <repo>/../shared/megatron-lm/core_v0.19.0 (or MEGATRON_LM_DIR). Stops after TIMEOUT seconds (default 120).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
CP="${CP:-4}"
ENTRY="${ENTRY:-gpt}"
STOCK_CP="${STOCK_CP:-}"
LAUNCH=()

if [ "$ENTRY" = hybrid ]; then
  FLAGS=(--hybrid-layer-pattern "${PATTERN:-M*-M*-}" --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2)
  [ "$CP" = 1 ] && FLAGS+=(--spec megatron_2d_dev.hybrid_cpu megatron_local_hybrid_stack_spec)
else
  FLAGS=(--num-layers 2)
fi
FLAGS+=(
  --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2
  --position-embedding-type rope --seq-length 128 --max-position-embeddings 128
  --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 64
  --micro-batch-size 1 --global-batch-size 2 --lr 1e-3 --train-iters 4 --mock-data --seed 1234
  --attention-dropout 0 --hidden-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 1000
  --distributed-timeout-minutes 10
)
if [ -n "$STOCK_CP" ]; then
  FLAGS+=(--bf16 --spec megatron_2d_dev.stock_cp_spec gpt_layer_spec_stock_cp)
  if [ "$CP" != 1 ]; then
    FLAGS+=(--context-parallel-size "$CP" --cp-comm-type "$STOCK_CP")
    [ "$STOCK_CP" = "a2a+p2p" ] && FLAGS+=(--hierarchical-context-parallel-sizes 2 $((CP / 2)))
  fi
  LAUNCH=(--te-release "${TE_RELEASE:-2.20.2}")
elif [ "$CP" != 1 ]; then
  FLAGS+=(--context-parallel-size "$CP" --cp-comm-type 2d --cp-2d-head-parallel-size 2 --cp-2d-inner-ring-size 2
          --cp-2d-placement head_first)
fi
if [ "${1:-}" = "--print-flags" ]; then printf '%s\n' "${FLAGS[@]}"; exit 0; fi

WORK="$(mktemp -d)"
CHILD=
trap 'rm -rf "$WORK"' EXIT
# a signal to this script goes to torchrun as SIGTERM (it terminates its workers on it; SIGINT would be ignored by a
# background job), and the script then waits for it, so the EXIT trap removes $WORK after the workers are gone
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null' INT TERM HUP
PATCHED=--patched; { [ "$CP" = 1 ] || [ -n "$STOCK_CP" ]; } && PATCHED=
SCRIPT="$("$PY" -m megatron_2d_dev.megatron_lm "$WORK" $PATCHED --script "pretrain_$ENTRY.py")"
# torchrun as a child, not exec'd (the EXIT trap must run); -k kills it if it does not stop. Its log folder
# (torchelastic_*, which torch never removes) and its workers' temporary files go in $WORK, removed with it.
TMPDIR="$WORK" timeout -k 10 "${TIMEOUT:-120}" "$(dirname "$PY")/torchrun" --standalone --nproc-per-node "$CP" \
  -m megatron_2d_dev.pretrain_cpu "${LAUNCH[@]}" "$SCRIPT" "${FLAGS[@]}" "$@" &
CHILD=$!
STATUS=0
wait "$CHILD" || STATUS=$?
while kill -0 "$CHILD" 2>/dev/null; do  # a trapped signal ended the wait early: wait for torchrun to stop
  STATUS=0
  wait "$CHILD" || STATUS=$?
done
exit "$STATUS"
