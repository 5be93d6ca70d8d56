"""scripts/build_tiny_model.py's pieces that run without training: each env's episode count, and the copy phase's
renamed TextCraft episodes (their items renamed consistently through every message)."""

import random
import re
import sys
from pathlib import Path

import pytest

import envs
from rl.model import load_tokenizer
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
    played = build.expert_episodes(fmt, "textcraft", envs.splits("textcraft")["train"][::8], 10, 4096)
    items = build.textcraft_items([t.messages[2]["content"] for t in played])
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
        before = build.textcraft_items([original.messages[2]["content"]])
        assert len(own) == len(before)  # (each item its own new name: one to one)
        renamed += own != before
    assert renamed > len(played) and crafted  # (new, but where a draw gave an item its own name back)
