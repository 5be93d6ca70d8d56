"""Loading models: the embedded tiny agent offline, clear errors for what cannot load."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from rl.flags import build
from rl.model import EMBEDDED, load_model, load_tokenizer, resolve
from rollout import ChatFormat


def test_embedded_model_is_a_qwen2_with_chatml():
    tokenizer = load_tokenizer("tiny-agent")
    model = load_model("tiny-agent")
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM's CPU kernels need it
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    fmt = ChatFormat(tokenizer)
    assert tokenizer.convert_ids_to_tokens(fmt.end_of_turn) == "<|im_end|>"
    assert fmt.observation_prefix == "\n<|im_start|>user\n"
    assert fmt.observation_suffix == "<|im_end|>\n<|im_start|>assistant\n"


def test_missing_local_directory_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        resolve(str(tmp_path / "nowhere"))


def test_unknown_hub_id_is_a_clear_error_offline():
    with pytest.raises(SystemExit, match="nobody/no-such-model is not a local directory, and it is not in the Hugging "
                                         "Face cache while hub downloads are off"):
        load_tokenizer("nobody/no-such-model")


def test_tokenizer_without_chat_template_is_refused():
    tokenizer = load_tokenizer("tiny-agent")
    tokenizer.chat_template = None
    with pytest.raises(SystemExit, match="has no chat template"):
        ChatFormat(tokenizer)


def declaring(tmp_path, quantization: dict):
    """The embedded model's directory with a quantization_config in its config.json, as a GGUF conversion leaves it."""
    model = shutil.copytree(EMBEDDED["tiny-agent"], tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    return model


GGUF = {"quant_method": "gguf", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dequantize": False}
REFUSED = r"model/config.json declares gguf quantization .its quantization_config entry., but the weights beside it are " \
          r"plain F32 tensors: remove the quantization_config entry from config.json"


def test_a_quantization_the_weights_do_not_have_is_refused_at_load(tmp_path):
    """A quantization_config over plain fp32 weights (vLLM: a traceback at start; HF: a failed first checkpoint) stops
    every loader, and train.py and eval.py before they play, with one sentence; weights stored quantized (integer
    tensors, as GPTQ's) are loaded as declared."""
    import eval as eval_script
    import train

    model = declaring(tmp_path, GGUF)
    for load in (resolve, load_tokenizer, load_model):
        with pytest.raises(SystemExit, match=REFUSED):
            load(str(model))
    with pytest.raises(SystemExit, match=REFUSED):
        train.main(train.parse_args(["--model", str(model), "--steps", "1", "--out-dir", str(tmp_path / "runs")]))
    assert not (tmp_path / "runs").exists()
    with pytest.raises(SystemExit, match=REFUSED):
        eval_script.main(build(eval_script.Args, model=str(model), engine="hf", out=str(tmp_path / "eval")))
    assert not list(tmp_path.glob("eval*"))
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "config.json").write_text((model / "config.json").read_text())
    save_file({"layer.qweight": torch.zeros(4, 4, dtype=torch.int32), "layer.scales": torch.ones(4)},
              str(packed / "model.safetensors"))
    assert resolve(str(packed)) == str(packed)
