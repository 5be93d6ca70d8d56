"""Which model: a Hugging Face hub id, a local directory, or the embedded tiny agent.

`--model tiny-agent` (the default) is a small Qwen2-architecture model that ships with the repo
(assets/tiny-agent, built by scripts/build_tiny_model.py): it needs no network and runs on a CPU.
Anything else is handed to transformers' from_pretrained, so `--model Qwen/Qwen2.5-3B-Instruct`
downloads as usual (set HF_HUB_OFFLINE=1 to forbid that). What cannot load (a directory that does not
exist, a hub id offline and not in the cache, an id the hub does not have) stops the script with one
sentence that says what to give instead: every model, tokenizer and config that train.py, eval.py and
--dry-run read comes through here, so they all say the same.

LoRA (PEFT): `add_lora` puts adapters on a model; a checkpoint of a LoRA run holds only the adapter
(adapter_config.json names its base), and `load_model` loads the base and the adapter on it. `full_weights`
is what an engine receives: every weight in the base model's naming, adapters merged in (W + s B A,
computed out of place, so the base weights never drift), sharded parameters gathered one at a time.
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
    """The local directory of `name`, or `name` itself for a hub id."""
    if Path(name).exists():
        return adapter_base(name) if is_adapter(name) else str(name)  # (an adapter: the model it adapts)
    if name in EMBEDDED:
        path = EMBEDDED[name]
        if not (path / "config.json").is_file():
            raise SystemExit(f"the embedded model {name} is missing from {path}; run `python scripts/build_tiny_model.py`")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise SystemExit(f"model directory {name} does not exist")
    return name  # a hub id


def _load(loader, name: str, **kwargs):
    source = resolve(name)
    _quiet_bars()
    try:
        return loader(source, **kwargs)
    except OSError as error:  # (transformers raises OSError for a missing file, an unknown id, no network)
        raise SystemExit(_cannot_load(name, source, error)) from None


def _cannot_load(name: str, source: str, error: OSError) -> str:
    """Why `name` did not load, and what to give instead, in one sentence."""
    from huggingface_hub.constants import is_offline_mode

    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if Path(source).is_dir():
        return f"cannot load the model directory {source} ({reason})"
    if is_offline_mode():
        return (f"{name} is not a local directory, and it is not in the Hugging Face cache while hub downloads are off "
                "(HF_HUB_OFFLINE=1): give a local model directory, or go online (unset HF_HUB_OFFLINE) to download it")
    return (f"cannot load {name} from the Hugging Face hub ({reason}): give a local model directory, or a hub id that "
            "exists and that this machine may download (network access; `huggingface-cli login` for a gated model)")


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


def load_config(name: str):
    """A model's config alone (--dry-run plans from it); for a LoRA checkpoint, its base's."""
    from transformers import AutoConfig

    return _load(AutoConfig.from_pretrained, name)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    tokenizer = _load(AutoTokenizer.from_pretrained, name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_adapter(name: str) -> bool:
    """A LoRA checkpoint: an adapter on a base model, not a whole model."""
    return (Path(name) / "adapter_config.json").is_file()


def adapter_base(name: str) -> str:
    """The base model a LoRA checkpoint's adapter was trained on."""
    import json

    return json.loads((Path(name) / "adapter_config.json").read_text())["base_model_name_or_path"]


def load_model(name: str, dtype: torch.dtype = torch.float32, trainable: bool = False, **kwargs):
    """A causal LM; for a LoRA checkpoint, its base with the adapter on it (trainable: for --resume)."""
    from transformers import AutoModelForCausalLM

    if is_adapter(name):
        from peft import PeftModel

        base = _load(AutoModelForCausalLM.from_pretrained, adapter_base(name), dtype=dtype, **kwargs)
        return PeftModel.from_pretrained(base, name, is_trainable=trainable)
    return _load(AutoModelForCausalLM.from_pretrained, name, dtype=dtype, **kwargs)


def add_lora(model, rank: int, alpha: float, targets: tuple[str, ...]):
    """LoRA adapters of `rank` on the `targets` modules (PEFT's "all-linear": every linear layer but the output
    layer); only they train. At first they add nothing (B = 0), so the model is the base model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=list(targets) if targets != ("all-linear",) else "all-linear")
    return get_peft_model(model, config)


def full_weights(model):
    """(name, tensor) of every weight, in the base model's naming, as an engine loads them: LoRA adapters merged
    in, and a sharded parameter (FSDP2's DTensor, ZeRO-3's partition) gathered whole, one module's at a time (every
    process must iterate alike)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from rl.zero3 import gathered

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    done = ()  # the prefixes of LoRA layers: their modules are yielded with the layer
    for prefix, module in base.named_modules(remove_duplicate=False):  # (a module under two names: both, as state_dict)
        if prefix.startswith(done):
            continue
        adapted = isinstance(module, LoraLayer)
        with gathered(module.parameters(recurse=adapted)):
            if adapted:
                done += (prefix + ".",)
                layer, merged = module, module.merged
                module = module.get_base_layer()
            for key, tensor in _own_state(module):
                if adapted and key == "weight" and not merged:
                    tensor = tensor + sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
                if hasattr(tensor, "full_tensor"):  # a DTensor: this process holds a shard
                    tensor = tensor.full_tensor()
                elif hasattr(tensor, "ds_id"):  # a ZeRO-3 partition, whole only inside the gather: copied out
                    tensor = tensor.clone()
                yield (f"{prefix}.{key}" if prefix else key), tensor.detach()


def _own_state(module):
    """A module's own entries of its state dict: its parameters and persistent buffers, not its children's."""
    for key, tensor in module._parameters.items():
        if tensor is not None:
            yield key, tensor
    for key, tensor in module._buffers.items():
        if tensor is not None and key not in module._non_persistent_buffers_set:
            yield key, tensor


def load_value_model(name: str, dtype: torch.dtype = torch.float32):
    """A critic for PPO: the same architecture as the policy, its own copy of the weights, and a
    one-output linear head on the last hidden state in place of the LM head (a token-classification
    model with one label; no dropout, so that values are deterministic). Loaded from a policy
    checkpoint, the head starts fresh; from a critic checkpoint, it is restored."""
    from transformers import AutoModelForTokenClassification

    from transformers.utils import logging as transformers_logging

    config = load_config(name)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its LOAD REPORT lists the head as new (and the LM head as unused)
    try:
        return _load(AutoModelForTokenClassification.from_pretrained, name, config=config, dtype=dtype)
    finally:
        transformers_logging.set_verbosity(verbosity)
