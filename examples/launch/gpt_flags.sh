# shellcheck shell=bash disable=SC2034  # arrays are used by the scripts that source this file
# Shared by the launch scripts: one GPT model and the context-parallel flags of each mode, so the modes can be
# compared side by side on the same model. Source it after setting MODE and CP.
#   MODE: p2p | a2a | a2a+p2p | all_gather (stock Megatron CP, Transformer Engine's) | 2d
#   HP, CP_INNER, WINDOW, PLACEMENT tune the modes that take them (defaults below).
: "${MODE:=2d}" "${CP:=8}" "${HP:=2}" "${WINDOW:=2}" "${PLACEMENT:=head_first}" "${SEQ:=131072}"
: "${TP:=1}" "${PP:=1}" "${MBS:=1}" "${GBS:=8}" "${TRAIN_ITERS:=50}"

MODEL_FLAGS=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAIN_FLAGS=(
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0
  --bf16 --use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --log-interval 1 --eval-iters 0 --eval-interval 1000 --log-throughput --timing-log-level 1
)
PARALLEL_FLAGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --context-parallel-size "$CP")
# with TP, sequence parallelism, as Megatron-Bridge's and NeMo's recipes run it (the 2d backend is the same under it)
if [ "$TP" -gt 1 ]; then PARALLEL_FLAGS+=(--sequence-parallel); fi
case "$MODE" in
  p2p)     CP_FLAGS=(--cp-comm-type p2p) ;;
  a2a)     CP_FLAGS=(--cp-comm-type a2a) ;;
  all_gather) CP_FLAGS=(--cp-comm-type all_gather) ;;
  a2a+p2p) CP_FLAGS=(--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "$HP" "$((CP / HP))") ;;
  2d)      CP_FLAGS=(--cp-comm-type 2d --cp-2d-head-parallel-size "$HP" --cp-2d-inner-ring-size "$WINDOW"
                     --cp-2d-placement "$PLACEMENT") ;;
  *) echo "MODE must be p2p, a2a, a2a+p2p, all_gather or 2d, got '$MODE'" >&2; exit 2 ;;
esac
export CUDA_DEVICE_MAX_CONNECTIONS=1
