# shellcheck shell=bash
# What every recipe shares, sourced by each: the paper's optimisation settings (AgentGym-RL's
# examples/train/*.sh: GRPO, lr 1e-6, k3 KL loss 0.001, entropy 0.001, clip 0.2, temperature 1.0,
# a checkpoint every 25 steps) and the launch on $GPUS processes of $MODEL.
#
# The paper trains Qwen2.5-3B- and 7B-Instruct on 8 GPUs. By default every data-parallel process holds the
# whole policy (fp32 weights and AdamW, about 16 bytes a parameter, plus an fp32 reference), which suits 3B
# on 80 GB GPUs; 7B needs sharded training: LAUNCH=configs/fsdp2.yaml (any Accelerate config; see
# docs/scale.md). DRY_RUN=1 bash scripts/recipes/<recipe>.sh prints the launch's memory plan first (train.py --dry-run
# with the recipe's flags, from any machine: no GPU held, no weights read). A recipe's --tasks-per-step must
# divide by GPUS.
#
# What upstream's trainer effectively optimises, which its scripts do not say: its actor
# (agent_actor/dp_actor.py, update_policy) makes ONE pass over the mini-batches whatever ppo_epochs
# says (the value only feeds an MFU metric), so every recipe runs --ppo-epochs 1; and it takes the
# token mean of each micro-batch of one trajectory, divided by the accumulation count and averaged
# over GPUs, so every trajectory weighs the same whatever its length: --loss-agg seq-mean-token-mean.
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
GPUS=${GPUS:-8}
LAUNCH=${LAUNCH:-}
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit

recipe() {  # recipe NAME FLAGS...: the recipe's own flags, then the command line's, come last and win
  local name=$1 plan
  shift
  set -- --model "$MODEL" --algo grpo \
    --lr 1e-6 --kl-coef 0.001 --kl-estimator k3 --entropy-coef 0.001 --clip 0.2 --temperature 1.0 \
    --loss-agg seq-mean-token-mean --micro-batch-size 1 --gradient-checkpointing --save-every 25 \
    --run-name "$name-$(date +%Y%m%d-%H%M%S)" "$@"
  if [[ -n ${DRY_RUN:-} ]]; then  # the launch config with this launch's process count, which the plan divides by
    plan=$(mktemp -d)/$(basename "${LAUNCH:-configs/ddp.yaml}")
    sed "s/^num_processes: .*/num_processes: $GPUS/" "${LAUNCH:-configs/ddp.yaml}" >"$plan"
    python train.py --dry-run --launch-config "$plan" "$@"
    rm -r "$(dirname "$plan")"
    return
  fi
  accelerate launch ${LAUNCH:+--config_file "$LAUNCH"} --num_processes "$GPUS" train.py "$@"
}

# ----------------------------------------------------------------------------------------------
# Rollout servers (python -m rl.rollout_server: vLLM on GPUs of its own, the trainer's weights broadcast to it after
# every update), for scripts/recipes/rollout-server-*.sh

MAX_MODEL_LEN=${MAX_MODEL_LEN:-16384}  # a server's context: at least any recipe's --max-tokens
SERVER_WAIT=${SERVER_WAIT:-1800}       # seconds a server may take to load the model and answer
SERVER_PIDS=()

serve() {  # serve GPUS PORT [FLAGS...]: a rollout server of $MODEL in the background on GPUS (0,1: tensor parallel 2)
  local gpus=$1 port=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$gpus python -m rl.rollout_server --model "$MODEL" --port "$port" \
    --tensor-parallel-size "$(($(tr -cd , <<<"$gpus" | wc -c) + 1))" --max-model-len "$MAX_MODEL_LEN" "$@" &
  SERVER_PIDS+=("$!")
}

wait_for_servers() {  # wait_for_servers HOST:PORT...: until each answers /info; stops if a server started here died
  local address pid deadline=$((SECONDS + SERVER_WAIT))
  for address in "$@"; do
    until python -c 'import sys, httpx; httpx.get(f"http://{sys.argv[1]}/info", timeout=5).raise_for_status()' \
      "$address" 2>/dev/null; do
      for pid in "${SERVER_PIDS[@]}"; do
        if ! kill -0 "$pid" 2>/dev/null; then
          echo "a rollout server started here exited (its output is above) before $address answered" >&2
          return 1
        fi
      done
      if ((SECONDS > deadline)); then
        echo "no rollout server answered at http://$address/info within $SERVER_WAIT s" >&2
        return 1
      fi
      sleep 5
    done
  done
}

stop_servers() {  # every rollout server this script started (trap stop_servers EXIT)
  if ((${#SERVER_PIDS[@]})); then
    kill "${SERVER_PIDS[@]}" 2>/dev/null || true
  fi
}
