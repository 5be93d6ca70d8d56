#!/usr/bin/env bash
# ScalingInter-RL on babyai: GRPO with the interaction horizon growing in stages, 6, 13, 20 turns, 100 steps a stage.
# The paper's recipe (AgentGym-RL examples/train/ScalingInter-RL/babyai_train.sh): 32 tasks x 4 samples
# a step, 4 optimizer steps of 8 tasks each, 1 PPO epoch (upstream's script says 2; its actor makes one pass), 20 epochs over the train split,
# 512 tokens a turn, 512 + 8192 tokens a trajectory.
#
#   bash scripts/recipes/babyai_scalinginter-rl.sh                 # GPUS=8 MODEL=Qwen/Qwen2.5-3B-Instruct (common.sh)
#   GPUS=2 bash scripts/recipes/babyai_scalinginter-rl.sh --epochs 1   # flags given here override the recipe
set -euo pipefail
source "$(dirname "$0")/common.sh"
recipe babyai-scalinginter-rl --env babyai --horizon 6 13 20 --horizon-every 100 \
  --tasks-per-step 32 --n 4 --minibatches 4 --ppo-epochs 1 --epochs 20 \
  --max-new-tokens 512 --max-tokens 8704 "$@"
