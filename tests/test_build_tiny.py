"""scripts/build_tiny_model.py's pieces: each env's episode count, the renamed TextCraft episodes (their items renamed
consistently through every message), and the expert episodes written to a folder here and fitted from it without
envs (--episodes, --play-only, --no-play: how a lent GPU fits what this machine played)."""

import random
import re
import sys
from pathlib import Path

import pytest
import torch

import envs
from rl.data import to_record
from rl.model import EMBEDDED, load_tokenizer
from rollout import ChatFormat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import build_tiny_model as build  # noqa: E402


def test_episode_counts_one_for_all_or_each_envs_own():
    assert build.episode_counts(["babyai", "textcraft"], ["300"]) == {"babyai": 300, "textcraft": 300}
    assert build.episode_counts(["babyai", "textcraft"], ["textcraft=50"]) == {"babyai": 2000, "textcraft": 50}
    assert build.episode_counts(["babyai", "textcraft"], ["10", "babyai=5"]) == {"babyai": 5, "textcraft": 10}
    for counts in (["sciworld=3"], ["1", "2"], ["textcraft=x"], ["babyai:3"], ["0"], ["textcraft=0"]):
        with pytest.raises(SystemExit, match="--sft-episodes"):
            build.episode_counts(["babyai", "textcraft"], counts)


def test_renamed_episodes_act_on_the_items_their_own_prompt_names():
    """Every variant's actions name only items of its own crafting commands (what the model must copy), each of the
    original's items under a new name of its own, and the expert's turns stay the trained tokens."""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    played = [to_record(t) for t in
              build.expert_episodes(fmt, "textcraft", envs.splits("textcraft")["train"][::8], 10, 4096)]
    items = build.textcraft_items([r["conversations"][2]["value"] for r in played])
    assert {"birch log", "birch wood"} <= set(items) or len(items) > 20
    variants = build.renamed(played, fmt, 2, random.Random(0), 4096)
    assert len(variants) == 2 * len(played)
    renamed = crafted = 0
    for original, variant in zip([t for t in played for _ in range(2)], variants):
        text = fmt.tokenizer.decode(variant.token_ids)
        prompt = text.split("Crafting commands:")[-1].split("<|im_end|>")[0]
        own = build.textcraft_items([prompt])
        for action in re.findall(r"Action:\n(.+?)<\|im_end\|>", text):
            named = re.sub(r"^(get|craft) \d+ ", "", action).split(" using ")
            parts = [named[0]] + ([p.strip().split(" ", 1)[1] for p in named[1].split(",")] if len(named) > 1 else [])
            assert all(part in own for part in parts), (action, own)
        assert sum(variant.loss_mask) > 0 and len(variant.token_ids) == len(variant.loss_mask)
        ids = re.findall(r"minecraft:([a-z_]+)", text)  # (the env's ids of crafted items: renamed as it writes them)
        assert all(item.replace("_", " ") in own for item in ids), (ids, own)
        crafted += len(ids)
        before = build.textcraft_items([original["conversations"][2]["value"]])
        assert len(own) == len(before)  # (each item its own new name: one to one)
        renamed += own != before
    assert renamed > len(played) and crafted  # (new, but where a draw gave an item its own name back)


@pytest.mark.slow  # (~20 s: a tokenizer, four small builds)
def test_episodes_played_here_fit_elsewhere_without_envs(tmp_path, monkeypatch, capsys):
    """--play-only trains a tokenizer and writes it with each env's train and test episodes and what they were played
    under; --no-play fits from them alone (no env is made: envs.make fails): from scratch on the folder's tokenizer,
    and with --from on the model's own (the records are text), renamed TextCraft copies included, writing the model,
    a bf16 snapshot of an earlier step, and the held-out NLL per env. What cannot work stops in one sentence."""
    from safetensors.torch import load_file

    folder, out = tmp_path / "episodes", tmp_path / "model"
    common = ["--envs", "babyai", "textcraft", "--horizon", "6", "--max-tokens", "2048", "--episodes", str(folder),
              "--out", str(tmp_path / "unwritten")]  # (never the default, the shipped assets/tiny-agent)

    def build_with(*flags):
        monkeypatch.setattr(sys, "argv", ["build", *common, *flags])
        build.main()

    build_with("--corpus-episodes", "3", "--sft-episodes", "3", "--eval-tasks", "2", "--play-only")
    tokenizer, train, test, played_under = build.load_episodes(folder)
    assert {n: len(r) for n, r in train.items()} == {"babyai": 3, "textcraft": 3}
    assert {n: len(r) for n, r in test.items()} == {"babyai": 2, "textcraft": 2}
    assert played_under == {"horizon": 6, "max_tokens": 2048}

    def no_env(*_, **__):
        raise AssertionError("an env was made")
    monkeypatch.setattr(envs, "make", no_env)
    build_with("--no-play", "--copies", "2", "--epochs", "2", "--hidden", "64", "--layers", "2", "--snapshots", "1",
               "--device", "cpu", "--out", str(out))
    assert re.search(r"held-out NLL per action token: babyai \d+\.\d+, textcraft \d+\.\d+", capsys.readouterr().out)
    assert load_tokenizer(str(out)).get_vocab() == tokenizer.get_vocab()
    snapshot, final = load_file(tmp_path / "model-step1" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in snapshot.values()) and final.keys() == snapshot.keys()
    assert any(not torch.equal(snapshot[k].float(), final[k].float().bfloat16().float()) for k in final)  # (step 1)
    from_model = tmp_path / "from"
    build_with("--no-play", "--from", str(EMBEDDED["tiny-agent"]), "--copies", "1", "--copy-steps", "2",
               "--snapshots", "2", "--device", "cpu", "--out", str(from_model))
    for name in ("tokenizer.json", "chat_template.jinja"):  # (the model's own files, byte for byte)
        assert (from_model / name).read_bytes() == (EMBEDDED["tiny-agent"] / name).read_bytes()
        assert (tmp_path / "from-step2" / name).read_bytes() == (EMBEDDED["tiny-agent"] / name).read_bytes()
    for flags, message in ((["--play-only"], "holds episodes already"),
                           (["--no-play", "--focus-steps", "2"], "--no-play leaves out"),
                           (["--no-play", "--epochs", "1", "--hidden", "64", "--snapshots", "999"], "this SFT runs"),
                           (["--no-play", "--from", str(EMBEDDED["tiny-agent"]), "--snapshots", "1"], "copy phase"),
                           (["--no-play", "--max-tokens", "1024"], "was played under --max-tokens 2048")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            build_with(*flags)
    assert not (tmp_path / "unwritten").exists()  # (a refused build writes nothing)
    with pytest.raises(SystemExit, match="--no-play needs --episodes"):
        monkeypatch.setattr(sys, "argv", ["build", "--no-play", "--envs", "babyai", "--episodes", str(tmp_path / "none"),
                                          "--out", str(tmp_path / "unwritten")])
        build.main()
    with pytest.raises(SystemExit, match="no episodes of sciworld"):
        monkeypatch.setattr(sys, "argv", ["build", "--no-play", "--envs", "babyai", "sciworld", "--episodes", str(folder),
                                          "--out", str(tmp_path / "unwritten")])
        build.main()
