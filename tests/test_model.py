"""Loading models: the embedded tiny agent offline, clear errors for what cannot load."""

import pytest

from rl.model import load_model, load_tokenizer, resolve
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
