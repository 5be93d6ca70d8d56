#!/usr/bin/env bash
# One command for a lent GPU (scripts/gpu_check.py says what it checks and prints): the rollout, update and LoRA
# sections in one process, the FSDP2 section under `accelerate launch` in another, then the table of both.
#
#   bash scripts/gpu_check.sh --prepare   # here, once, with the network: fills .gpu/ (ignored by git)
#   bash scripts/gpu_check.sh             # on the GPU machine; the device tool's call:
#       run(command="set -o pipefail; bash scripts/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log", carry=[".gpu"], timeout_s=600)
#   bash scripts/gpu_check.sh --smoke     # on a CPU: tiny sizes, the same code (about a minute)
#
# GPU_CHECK_DIR (default /tmp/gpu_check) holds the random models, the installed wheels and results.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$(command -v python3 || command -v python)}  # (the lent machine: python3)
if [[ " $* " == *" --prepare "* ]]; then
  exec "$python" scripts/gpu_check.py --prepare
fi
work=${GPU_CHECK_DIR:-/tmp/gpu_check}
export GPU_CHECK_DIR=$work PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYGAME_HIDE_SUPPORT_PROMPT=1
mkdir -p "$work"
# the wheels of .gpu/ (gpu_check.py --prepare) where their packages are missing, as on the lent machine
if [[ -d .gpu/whl ]] && ! "$python" -c "import tyro, minigrid, gymnasium, pygame" 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
    .gpu/whl/*.whl || exit 1
  export PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}
fi
# each process stopped well inside a 10-minute call, so that the table still comes (none for the CPU smoke run)
if [[ " $* " == *" --smoke "* ]]; then limits=(0 0); else limits=(${GPU_CHECK_LIMITS:-420 150}); fi
status=0
timeout "${limits[0]}" "$python" scripts/gpu_check.py "$@" || status=1
if "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  launch=(scripts/gpu_check.py)
else  # FSDP2 on a CPU process: tests/cpu_fsdp.py lifts Accelerate's GPU-only gate on FSDP (see there)
  export ACCELERATE_USE_CPU=1
  launch=(tests/cpu_fsdp.py scripts/gpu_check.py)
fi
timeout "${limits[1]}" "$python" -m accelerate.commands.launch --config_file configs/fsdp2.yaml --num_processes 1 \
  --num_machines 1 --dynamo_backend no "${launch[@]}" --fsdp2 "$@" || status=1
"$python" scripts/gpu_check.py --summary || status=1
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp "$work/results.jsonl" "$OUT/" 2>/dev/null; fi
exit $status
