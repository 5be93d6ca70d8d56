"""Long horizons' context (issue 46): --max-obs-tokens cuts an observation longer than N tokens to its head and tail
with a marker between, in the conversation as in the tokens (so a rollout stays token-exact), and counts the cut."""

import pytest

import envs
from rl.agent import LayoutArgs
from rl.chat import CUT
from rl.engines.api import APIFormat
from rl.metrics import env_metrics, obs_cut
from rl.model import load_model, load_tokenizer
from rollout import ChatFormat, HFEngine, rollout
from tests.test_token_exactness import Spy, check_exact


class Pages(envs.Env):
    """An env whose observations are long pages (WebArena's accessibility trees, shortened): `words` words, the first
    and last of which say where they are."""

    name, instruction, ack = "pages", "Browse.", "OK."

    def __init__(self, words):
        self.words = words

    def page(self, n):
        return f"START page {n} " + " ".join(f"item{i} é 漢字" for i in range(self.words)) + f" END page {n}"

    def reset(self, task_id):
        self.n = 0
        return self.page(0)

    def step(self, text):
        self.n += 1
        return envs.StepResult(self.page(self.n), 0.5, self.n == 3)


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_a_long_observation_is_cut_to_its_head_and_tail_where_tokens_start(real_tokenizer, template):
    tokenizer = load_tokenizer("tiny-agent") if template == "chatml" else real_tokenizer(template)
    fmt = ChatFormat(tokenizer, max_obs_tokens=64)
    page = Pages(400).page(1)
    ids = fmt.encode(page)
    text, over = fmt.cut(page)
    assert over == len(ids) - 64 and CUT.format(over) in text
    head, tail = text.split(CUT.format(over))
    assert page.startswith(head) and page.endswith(tail) and "\ufffd" not in text  # (whole characters)
    # the first and last N/2 tokens (a token that starts inside a character, a byte-level BPE's, takes the whole
    # character along: one token more at most)
    assert fmt.encode(head)[:31] == ids[:31] and fmt.encode(tail)[-31:] == ids[-31:]
    assert len(fmt.encode(head)) in (32, 33) and len(fmt.encode(tail)) in (32, 33)
    assert fmt.cut("short page") == ("short page", 0) and ChatFormat(tokenizer).cut(page) == (page, 0)
    fits = tokenizer.decode(fmt.encode(" ".join(["word"] * 200))[:64])
    assert len(fmt.encode(fits)) == 64 and fmt.cut(fits) == (fits, 0)  # (exactly N tokens: kept whole)


def test_a_rollout_of_long_pages_plays_on_cut_observations_token_exact_and_counts_them():
    """Every page is cut (the first one too) and the episode goes on where the whole pages would have filled the
    budget after one turn; the trajectory is token-exact on the cut conversation, and the share cut is a metric."""
    tokenizer, model = load_tokenizer("tiny-agent"), load_model("tiny-agent")
    outcomes = {}
    for limit in (0, 96):
        fmt = ChatFormat(tokenizer, max_obs_tokens=limit)
        spy = Spy(HFEngine(model, fmt, temperature=1.0, seed=0), fmt)
        traj, = rollout(spy, fmt, [Pages(1500)], [0], [0], horizon=3, max_new_tokens=16, max_tokens=3072)
        outcomes[limit] = traj
        if limit:
            assert check_exact(fmt, spy, [traj]) == 1
    whole, cut = outcomes[0], outcomes[96]
    assert whole.finish == "max_tokens" and whole.turns <= 1 and whole.obs_cut == 0
    assert cut.finish == "done" and cut.turns == 3 and cut.observations == 4 and cut.obs_cut == 4
    assert all("tokens cut ...]" in m["content"] and m["content"].startswith("START page")
               and m["content"].endswith(f"END page {k}") for k, m in enumerate(cut.messages[2::2]))
    assert len(cut.token_ids) < 1000
    record = cut.log_record()
    assert (record["observations"], record["obs_cut"]) == (4, 4)
    records = [record | {"item_id": "pages_0"}, {**record, "item_id": "babyai_1", "observations": 4, "obs_cut": 0}]
    assert obs_cut(records) == 0.5 and env_metrics(records)["rollout/pages/obs_cut"] == 1.0


def test_max_obs_tokens_says_what_cannot_work():
    with pytest.raises(SystemExit, match="at least 16"):
        LayoutArgs(max_obs_tokens=8).check("babyai")
    LayoutArgs(max_obs_tokens=16).check("babyai")
    with pytest.raises(SystemExit, match="behind an API"):
        APIFormat(max_obs_tokens=512)


def test_eval_plays_a_runs_own_cut_unless_told_otherwise():
    import eval as eval_script
    from rl.agent import run_layout
    from rl.flags import build

    own = {"max_obs_tokens": 256, "agent": "react", "reasoning": "keep"}
    assert run_layout(build(eval_script.Args), own)["max_obs_tokens"] == 256
    assert run_layout(build(eval_script.Args, max_obs_tokens=0), own)["max_obs_tokens"] == 0
    assert run_layout(build(eval_script.Args), {})["max_obs_tokens"] == 0
    assert run_layout(build(eval_script.Args, max_obs_tokens=64), {})["max_obs_tokens"] == 64
