#!/usr/bin/env bash
# AgentGym-RL on webarena: GRPO with a fixed horizon of 15 turns.
# The paper's recipe (AgentGym-RL examples/train/AgentGym-RL/webarena_train.sh): 32 tasks x 4 samples
# a step, 8 optimizer steps of 4 tasks each, 1 PPO epoch (upstream's script says 2; its actor makes one pass), 25 epochs over the train split,
# 512 tokens a turn, 750 + 14098 tokens a trajectory.
#
#   bash scripts/recipes/webarena_agentgym-rl.sh                 # GPUS=8 MODEL=Qwen/Qwen2.5-3B-Instruct (common.sh)
#   GPUS=2 bash scripts/recipes/webarena_agentgym-rl.sh --epochs 1   # flags given here override the recipe
set -euo pipefail
source "$(dirname "$0")/common.sh"
recipe webarena-agentgym-rl --env webarena --horizon 15 \
  --tasks-per-step 32 --n 4 --minibatches 8 --ppo-epochs 1 --epochs 25 \
  --max-new-tokens 512 --max-tokens 14848 "$@"
