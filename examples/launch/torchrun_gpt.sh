#!/usr/bin/env bash
# One node (or one node of a multi-node job): GPT pretraining with the chosen context-parallel mode.
#   MODE=2d CP=8 HP=2 WINDOW=2 bash examples/launch/torchrun_gpt.sh
#   MODE=p2p CP=8 bash examples/launch/torchrun_gpt.sh          # stock Megatron ring, same model
#   MODE=a2a+p2p CP=8 HP=2 bash examples/launch/torchrun_gpt.sh  # stock hierarchical CP, same model
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT as for any torchrun job.
# examples/pretrain_gpt_2d.py imports Megatron-LM's pretrain_gpt.py: set MEGATRON_LM_DIR to a checkout at core_v0.19.0.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=examples/launch/gpt_flags.sh
source "$HERE/gpt_flags.sh"
: "${GPUS_PER_NODE:=8}" "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=localhost}" "${MASTER_PORT:=6000}"
torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$HERE/../pretrain_gpt_2d.py" "${MODEL_FLAGS[@]}" "${TRAIN_FLAGS[@]}" "${PARALLEL_FLAGS[@]}" "${CP_FLAGS[@]}" "$@"
