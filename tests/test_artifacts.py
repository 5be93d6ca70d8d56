"""The real templates, tokenizers and model that set-up fetches (rl/artifacts.py): every file as pinned, a file that
differs refused with one sentence (at use and at fetch, writing nothing), and the files are what they claim to be."""

import shutil
import zipfile

import pytest

from rl import artifacts


def test_every_artifact_is_fetched_and_as_pinned():
    problems = [why for why in map(artifacts.problem, artifacts.ARTIFACTS) if why is not None]
    assert not problems, "; ".join(problems) + ": run `python -m rl.artifacts` (setup.sh does)"


@pytest.fixture
def copied(tmp_path, monkeypatch):
    """The templates and Qwen3's tokenizer config copied into a cache of the test's own."""
    for name in ("templates/qwen3.jinja", "tokenizers/qwen3/tokenizer_config.json"):
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(artifacts.path(name), target)
    monkeypatch.setenv("AGENTGYM_RL_ARTIFACTS", str(tmp_path))
    return tmp_path


def test_a_file_that_differs_or_is_missing_is_refused_in_one_sentence(copied):
    assert artifacts.path("templates/qwen3.jinja") == copied / "templates/qwen3.jinja"
    edited = copied / "tokenizers/qwen3/tokenizer_config.json"
    edited.write_bytes(edited.read_bytes().replace(b"<think>", b"<thonk>"))  # same size, another hash
    with pytest.raises(SystemExit, match=r"sha256 .*not the pinned .*run `python -m rl.artifacts`"):
        artifacts.path("tokenizers/qwen3/tokenizer_config.json")
    with pytest.raises(SystemExit, match=r"is not fetched .*missing"):
        artifacts.path("templates/llama3_1.jinja")
    with pytest.raises(SystemExit, match="unknown artifact 'templates/nope'"):
        artifacts.path("templates/nope")


def test_fetch_checks_what_it_downloads_and_writes_nothing_that_differs(copied):
    def wheel(text: bytes):
        def download(package, folder):
            archive = folder / "trl-1.16.0-py3-none-any.whl"
            with zipfile.ZipFile(archive, "w") as out:
                out.writestr("trl/chat_templates/qwen2_5.jinja", text)
            return archive
        return download

    with pytest.raises(SystemExit, match=r"templates/qwen2_5.jinja from trl==1.16.0 has sha256 .*refused"):
        artifacts.fetch(["templates/qwen2_5.jinja"], download=wheel(b"x" * 2507))  # (the pinned size, another hash)
    assert not (copied / "templates/qwen2_5.jinja").exists()
    assert not list(copied.rglob("*.partial"))
    # a derived template comes from its checked source, with upstream's own hash
    assert artifacts.fetch(["templates/qwen3_thinking_2507.jinja"]) == ["templates/qwen3_thinking_2507.jinja"]
    assert artifacts.path("templates/qwen3_thinking_2507.jinja").read_text().endswith("<think>\\n' }}\n{%- endif %}")
    assert artifacts.fetch(["templates/qwen3.jinja"]) == []  # (already as pinned: nothing to fetch)


@pytest.mark.slow  # (~12 s: three tokenizers of 9-28 MB)
def test_the_real_tokenizers_and_templates_load_and_render():
    from transformers import AutoTokenizer

    qwen3 = AutoTokenizer.from_pretrained(str(artifacts.path("tokenizers/qwen3/tokenizer.json").parent))
    assert len(qwen3) > 151_000
    assert qwen3.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]
    messages = [{"role": "user", "content": "go north"}]
    off = qwen3.apply_chat_template(messages, chat_template=artifacts.path("templates/qwen3.jinja").read_text(),
                                    tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = qwen3.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=artifacts.path("templates/qwen3_thinking_2507.jinja").read_text())
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    llama = AutoTokenizer.from_pretrained(str(artifacts.path("tokenizers/llama3/tokenizer.json").parent))
    assert llama.convert_tokens_to_ids("<|eot_id|>") == 128009
    gptoss = AutoTokenizer.from_pretrained(str(artifacts.path("tokenizers/gptoss/tokenizer.json").parent))
    assert gptoss.convert_tokens_to_ids("<|channel|>") == 200005


@pytest.mark.slow  # (~10-20 s: a 540 MB model)
def test_smollm2_is_a_named_model_that_loads_as_a_plain_directory_and_answers():
    import torch

    from rl.model import load_model, load_tokenizer, resolve

    directory = resolve("smollm2-135m")
    assert directory == str(artifacts.named_model("smollm2-135m"))
    config = (artifacts.named_model("smollm2-135m") / "config.json").read_text()
    assert "quantization_config" not in config  # (the GGUF's entry would make vLLM and save_pretrained fail)
    tokenizer, model = load_tokenizer("smollm2-135m"), load_model("smollm2-135m")
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])  # (pretrained: it knows, a random model would not)
