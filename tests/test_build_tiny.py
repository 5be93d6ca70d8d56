"""scripts/build_tiny_model.py's pieces: each env's episode count, the renamed TextCraft episodes (their items renamed
consistently through every message), and the expert episodes written to a folder here and fitted from it without
envs (--episodes, --play-only, --no-play: how a lent GPU fits what this machine played)."""

import random
import re
import sys
from pathlib import Path

import pytest

import envs
from rl.data import to_record
from rl.model import EMBEDDED, load_model, load_tokenizer
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


def test_episodes_played_here_fit_elsewhere_without_envs(tmp_path, monkeypatch, capsys):
    """--play-only writes the tokenizer and each env's train and test episodes; --no-play fits from them alone (no env
    is made: envs.make fails), renamed TextCraft copies included, and writes the model, its snapshot in bf16 and the
    held-out NLL per env; what the folder holds reads back as it was played."""
    folder, out = tmp_path / "episodes", tmp_path / "model"
    common = ["--envs", "babyai", "textcraft", "--horizon", "6", "--max-tokens", "2048", "--episodes", str(folder)]
    monkeypatch.setattr(sys, "argv", ["build", "--from", str(EMBEDDED["tiny-agent"]), "--sft-episodes", "3",
                                      "--eval-tasks", "2", "--play-only", *common])
    build.main()
    tokenizer, train, test = build.load_episodes(folder)
    assert {n: len(r) for n, r in train.items()} == {"babyai": 3, "textcraft": 3}
    assert {n: len(r) for n, r in test.items()} == {"babyai": 2, "textcraft": 2}
    assert len(tokenizer) == len(load_tokenizer("tiny-agent"))
    fmt = ChatFormat(tokenizer)
    assert build.encoded_episodes(fmt, train["babyai"], 2048)[0].token_ids == \
        build.encoded_episodes(ChatFormat(load_tokenizer("tiny-agent")), train["babyai"], 2048)[0].token_ids

    def no_env(*_, **__):
        raise AssertionError("an env was made")
    monkeypatch.setattr(envs, "make", no_env)
    monkeypatch.setattr(sys, "argv", ["build", "--no-play", "--copies", "2", "--epochs", "1", "--hidden", "64",
                                      "--layers", "2", "--snapshots", "1", "--device", "cpu", "--out", str(out),
                                      *common])
    build.main()
    assert re.search(r"held-out NLL per action token: babyai \d+\.\d+, textcraft \d+\.\d+", capsys.readouterr().out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    snapshot = load_model(str(tmp_path / "model-step1"))
    assert sum(p.numel() for p in snapshot.parameters()) == sum(p.numel() for p in load_model(str(out)).parameters())
    with pytest.raises(SystemExit, match="--no-play needs --episodes"):
        monkeypatch.setattr(sys, "argv", ["build", "--no-play", "--envs", "babyai", "--episodes", str(tmp_path / "none")])
        build.main()
    with pytest.raises(SystemExit, match="no episodes of sciworld"):
        monkeypatch.setattr(sys, "argv", ["build", "--no-play", "--envs", "babyai", "sciworld", "--episodes", str(folder)])
        build.main()
