#!/usr/bin/env bash
# ScalingInter-RL on sciworld: GRPO with the interaction horizon growing in stages, 10, 20, 30 turns, 100 steps a stage.
# The paper's recipe (AgentGym-RL examples/train/ScalingInter-RL/sciworld_train.sh): 16 tasks x 8 samples
# a step, 2 optimizer steps of 8 tasks each, 1 PPO epoch, 10 epochs over the train split,
# 200 tokens a turn, 1024 + 8192 tokens a trajectory.
#
#   bash scripts/recipes/sciworld_scalinginter-rl.sh                 # GPUS=8 MODEL=Qwen/Qwen2.5-3B-Instruct (common.sh)
#   GPUS=2 bash scripts/recipes/sciworld_scalinginter-rl.sh --epochs 1   # flags given here override the recipe
set -euo pipefail
source "$(dirname "$0")/common.sh"
recipe sciworld-scalinginter-rl --env sciworld --horizon 10 20 30 --horizon-every 100 \
  --tasks-per-step 16 --n 8 --minibatches 2 --ppo-epochs 1 --epochs 10 \
  --max-new-tokens 200 --max-tokens 9216 "$@"
