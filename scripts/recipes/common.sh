# What every recipe shares, sourced by each: the paper's optimisation settings (AgentGym-RL's
# examples/train/*.sh: GRPO, lr 1e-6, k3 KL loss 0.001, entropy 0.001, clip 0.2, temperature 1.0,
# a checkpoint every 25 steps) and the launch on $GPUS processes of $MODEL.
#
# The paper trains Qwen2.5-3B- and 7B-Instruct on 8 GPUs. By default every data-parallel process holds the
# whole policy (fp32 weights and AdamW, about 16 bytes a parameter, plus an fp32 reference), which suits 3B
# on 80 GB GPUs; 7B needs sharded training: LAUNCH=configs/fsdp2.yaml (any Accelerate config; see README,
# "Scale"). `python train.py --dry-run ...` with the recipe's flags prints the memory plan first. A recipe's
# --tasks-per-step must divide by GPUS.
#
# What upstream's trainer effectively optimises, which its scripts do not say: its actor
# (agent_actor/dp_actor.py, update_policy) makes ONE pass over the mini-batches whatever ppo_epochs
# says (the value only feeds an MFU metric), so every recipe runs --ppo-epochs 1; and it takes the
# token mean of each micro-batch of one trajectory, divided by the accumulation count and averaged
# over GPUs, so every trajectory weighs the same whatever its length: --loss-agg seq-mean-token-mean.
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
GPUS=${GPUS:-8}
LAUNCH=${LAUNCH:-}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

recipe() {  # recipe NAME FLAGS...: the recipe's own flags, then the command line's, come last and win
  local name=$1
  shift
  accelerate launch ${LAUNCH:+--config_file "$LAUNCH"} --num_processes "$GPUS" train.py \
    --model "$MODEL" --algo grpo \
    --lr 1e-6 --kl-coef 0.001 --kl-estimator k3 --entropy-coef 0.001 --clip 0.2 --temperature 1.0 \
    --loss-agg seq-mean-token-mean --micro-batch-size 1 --gradient-checkpointing --save-every 25 \
    --run-name "$name-$(date +%Y%m%d-%H%M%S)" "$@"
}
