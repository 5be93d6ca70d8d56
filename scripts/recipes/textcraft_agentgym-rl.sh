#!/usr/bin/env bash
# AgentGym-RL on textcraft: GRPO with a fixed horizon of 30 turns.
# The paper's recipe (AgentGym-RL examples/train/AgentGym-RL/textcraft_train.sh): 32 tasks x 8 samples
# a step, 4 optimizer steps of 8 tasks each, 1 PPO epoch (upstream's script says 2; its actor makes one pass), 30 epochs over the train split,
# 512 tokens a turn, 512 + 10240 tokens a trajectory.
#
#   bash scripts/recipes/textcraft_agentgym-rl.sh                 # GPUS=8 MODEL=Qwen/Qwen2.5-3B-Instruct (common.sh)
#   GPUS=2 bash scripts/recipes/textcraft_agentgym-rl.sh --epochs 1   # flags given here override the recipe
set -euo pipefail
source "$(dirname "$0")/common.sh"
recipe textcraft-agentgym-rl --env textcraft --horizon 30 \
  --tasks-per-step 32 --n 8 --minibatches 4 --ppo-epochs 1 --epochs 30 \
  --max-new-tokens 512 --max-tokens 10752 "$@"
