"""Which model: a Hugging Face hub id, a local directory, or the embedded tiny agent.

`--model tiny-agent` (the default) is a small Qwen2-architecture model that ships with the repo
(assets/tiny-agent, built by scripts/build_tiny_model.py): it needs no network and runs on a CPU.
Anything else is handed to transformers' from_pretrained, so `--model Qwen/Qwen2.5-3B-Instruct`
downloads as usual (set HF_HUB_OFFLINE=1 to forbid that).
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = {"tiny-agent": ROOT / "assets" / "tiny-agent"}
# How the embedded model plays (its preset in train.py, and eval.py's settings for it): short turns
# and trajectories, sized to run on two CPU cores in minutes.
EMBEDDED_ROLLOUT = {"env": "babyai", "horizon": 6, "max_new_tokens": 48, "max_tokens": 3072}


def resolve(name: str) -> str:
    if Path(name).exists():
        return str(name)
    if name in EMBEDDED:
        path = EMBEDDED[name]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the embedded model {name} is missing from {path}; run `python scripts/build_tiny_model.py`")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model directory {name} does not exist")
    return name  # a hub id


def _load(loader, name: str, **kwargs):
    source = resolve(name)
    _quiet_bars()
    try:
        return loader(source, **kwargs)
    except OSError as error:
        raise OSError(
            f"could not load {name!r}: {error}\nPass a local model directory or a Hugging Face id; "
            "hub downloads need network access (HF_HUB_OFFLINE=1 turns them off)."
        ) from error


def _quiet_bars() -> None:
    """Turn off transformers' own progress bars ("Loading weights", "Writing model shards": one for every model
    loaded or saved, each done in a moment) and keep the hub's, which show a first download of a large model."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as transformers_logging

    if transformers_logging.is_progress_bar_enabled():
        downloads_shown = not hub.are_progress_bars_disabled()
        transformers_logging.disable_progress_bar()  # (which also turns the hub's off)
        if downloads_shown:
            hub.enable_progress_bars()


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    tokenizer = _load(AutoTokenizer.from_pretrained, name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, dtype: torch.dtype = torch.float32, **kwargs):
    from transformers import AutoModelForCausalLM

    return _load(AutoModelForCausalLM.from_pretrained, name, dtype=dtype, **kwargs)


def load_value_model(name: str, dtype: torch.dtype = torch.float32):
    """A critic for PPO: the same architecture as the policy, its own copy of the weights, and a
    one-output linear head on the last hidden state in place of the LM head (a token-classification
    model with one label; no dropout, so that values are deterministic). Loaded from a policy
    checkpoint, the head starts fresh; from a critic checkpoint, it is restored."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from transformers.utils import logging as transformers_logging

    config = _load(AutoConfig.from_pretrained, name)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its LOAD REPORT lists the head as new (and the LM head as unused)
    try:
        return _load(AutoModelForTokenClassification.from_pretrained, name, config=config, dtype=dtype)
    finally:
        transformers_logging.set_verbosity(verbosity)
