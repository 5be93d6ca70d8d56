#!/usr/bin/env bash
# Two nodes of 8 GPUs (issue 33): node A serves rollouts on all of its GPUs, 8/TP rollout servers at tensor parallel
# TP (4 x 2 by default, TP=4 for 2 x 4), reachable from other hosts (--host 0.0.0.0, ports PORT, PORT+1, ...); node B
# trains with FSDP2 on its 8 and plays every trajectory on A's servers (a task's group on one server, the groups
# spread over them). After each update B's rank 0 broadcasts the weights, in buckets, once over one NCCL group with
# every server's workers: B must reach A's server ports, and A's GPUs B's rank 0, which hosts the group's store on a
# free port. RECIPE names the paper recipe (scripts/recipes/<env>_<method>.sh), MODEL the model (the same on both
# nodes).
#
# Check first, from any machine, no GPU held: the memory plan of B's GPUs (no engine on them) and of each server
# GPU (its 1/TP of the bf16 weights, KV cache in the rest), and the split:
#   DRY_RUN=1 SERVER_HOST=10.0.0.2 bash scripts/recipes/rollout-server-two-nodes.sh train
# Then:
#   bash scripts/recipes/rollout-server-two-nodes.sh serve                               # node A, until stopped
#   SERVER_HOST=10.0.0.2 bash scripts/recipes/rollout-server-two-nodes.sh train --epochs 1   # node B: A's address
# Not yet run on GPUs here: NCCL between nodes is untested (rl/engines/server.py).
set -euo pipefail
export MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
RECIPE=${RECIPE:-babyai_agentgym-rl}
TP=${TP:-2}
PORT=${PORT:-8900}
SERVER_HOST=${SERVER_HOST:-}
role=${1:-}
shift $(($# > 0))
source "$(dirname "$0")/common.sh"

if ((TP < 1 || 8 % TP)); then
  echo "TP=$TP: the 8 GPUs of node A split into servers of TP GPUs each: 1, 2, 4 or 8" >&2
  exit 1
fi
servers=()
for ((i = 0; i < 8 / TP; i++)); do
  servers+=("${SERVER_HOST:-127.0.0.1}:$((PORT + i))")
done
case $role in
  serve)
    trap stop_servers EXIT
    for ((i = 0; i < 8 / TP; i++)); do
      serve "$(seq -s, $((i * TP)) $((i * TP + TP - 1)))" $((PORT + i)) --host 0.0.0.0
    done
    wait_for_servers "${servers[@]}"
    echo "serving $MODEL on ${#servers[@]} rollout servers at tensor parallel $TP, ports $PORT-$((PORT + 8 / TP - 1))"
    wait
    ;;
  train)
    if [[ -z $SERVER_HOST ]]; then
      echo "SERVER_HOST: node A's address, as this node reaches it (SERVER_HOST=10.0.0.2 bash $0 train)" >&2
      exit 1
    fi
    if [[ -z ${DRY_RUN:-} ]]; then
      wait_for_servers "${servers[@]}"
    fi
    GPUS=8 LAUNCH=configs/fsdp2.yaml bash "scripts/recipes/$RECIPE.sh" \
      --rollout-server "${servers[@]}" --vllm-tensor-parallel-size "$TP" "$@"
    ;;
  *)
    echo "usage: bash $0 serve (node A) | SERVER_HOST=<node A> bash $0 train [FLAGS...] (node B)" >&2
    exit 1
    ;;
esac
