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


# ----------------------------------------------------------------------------------------------
# --context window:K: the opening and the last K turns, a new segment each time the window slides


LONG = [15, 32, 5]  # BabyAI test tasks whose expert takes 8, 10 and 12 turns or more


def window_episodes(name, k=2, count=2, horizon=6, engine_of=None, task_ids=None, agent="react", reasoning="keep"):
    """Expert episodes of env `name`'s first test tasks (or `task_ids`) under window:k (or `engine_of`'s), played by
    format `agent` under --reasoning `reasoning`, with the prompts and samples the engine saw
    (tests/test_token_exactness.Spy)."""
    from rl.agent import make_agent
    from rl.context import Context
    from rollout import ExpertEngine

    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    task_ids = task_ids or envs.splits(name)["test"][:count]
    environments = [envs.make(name) for _ in task_ids]
    engine = (engine_of or (lambda e: ExpertEngine(fmt, e)))(environments)
    spy = Spy(engine, fmt)
    try:
        trajectories = rollout(spy, fmt, environments, task_ids, list(range(len(task_ids))), horizon=horizon,
                               max_new_tokens=256, max_tokens=16384,
                               agent=make_agent(agent, 1, Context.parse(f"window:{k}", reasoning)))
    finally:
        for env in environments:
            env.close()
    return fmt, spy, trajectories


def check_window(fmt, spy, trajectories, k, every=False):
    """Turn t's prompt holds the opening and turns max(1, t - k) .. t - 1: within a segment it extends the last prompt
    by the sampled tokens and the observation exactly, and where the window slid (every turn after turn k + 1) it is
    the template's rendering of the kept messages; each segment's tokens are its first prompt and its sampled turns,
    trained on them alone; the last segment is the live context. `every` (--reasoning drop): every turn renders."""
    checked = 0
    for traj in trajectories:
        prompts, samples, opening = spy.prompts[traj.row], spy.samples[traj.row], traj.context.opening
        assert len(prompts) == traj.turns and opening == 3
        starts = list(range(traj.turns)) if every else [0, *range(k + 1, traj.turns)]  # (the turns opening a segment)
        assert len(traj.sequences) == len(starts) == (traj.turns if every else max(1, traj.turns - k))
        for t, prompt in enumerate(prompts):
            dropped = max(0, t - k)  # turns gone from turn t's prompt
            kept = traj.messages[:opening] + traj.messages[opening + 2 * dropped:opening + 2 * t]
            if t in starts:
                assert prompt == fmt.prompt(kept, tools=traj.tools), (traj.env, t)
            else:
                closed = samples[t - 1] + ([] if samples[t - 1][-1:] == [fmt.end_of_turn] else [fmt.end_of_turn])
                answer = traj.messages[opening + 2 * t - 1]
                observation = fmt.observation(answer["content"], answer["role"])
                assert prompt == prompts[t - 1] + closed + observation, (traj.env, t)
            checked += 1
        for s, (ids, mask, _) in enumerate(traj.sequences):
            turns = range(starts[s], starts[s + 1] if s + 1 < len(starts) else traj.turns)
            assert ids[:len(prompts[turns[0]])] == prompts[turns[0]] and not any(mask[:len(prompts[turns[0]])])
            assert [t for t, m in zip(ids, mask) if m] == [x for t in turns for x in samples[t]]
        assert traj.token_ids == traj.sequences[-1][0] and traj.prompt_tokens == [len(p) for p in prompts]
        assert traj.log_record()["segments"] == len(traj.sequences)
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("name", envs.ENVS)
def test_a_window_keeps_the_opening_and_the_last_k_turns_token_exact_on_every_env(name):
    fmt, spy, trajectories = window_episodes(name, k=2, horizon=6, task_ids=LONG[:2] if name == "babyai" else None)
    assert all(t.error is None or "expert failed" in t.error for t in trajectories)
    assert check_window(fmt, spy, trajectories, 2) >= 2
    if max(t.turns for t in trajectories) > 3:  # (an episode long enough to slide: its prompts stop growing)
        longest = max(trajectories, key=lambda t: t.turns)
        assert len(longest.sequences) > 1


def test_a_window_wider_than_the_episode_is_the_full_layout_and_a_slid_one_stays_flat():
    from rl.context import Context

    fmt, spy, wide = window_episodes("babyai", k=20, horizon=8, task_ids=LONG)
    _, _, narrow = window_episodes("babyai", k=1, horizon=8, task_ids=LONG)
    for traj in wide:
        assert len(traj.sequences) == 1 and traj.sequences[0][0] == traj.token_ids  # (never slid: one segment)
    long = max(narrow, key=lambda t: t.turns)
    assert long.turns >= 5 and len(long.sequences) == long.turns - 1
    assert max(long.prompt_tokens[2:]) - min(long.prompt_tokens[2:]) < 80  # (flat: the opening and one turn)
    assert max(t.prompt_tokens[-1] for t in wide) > max(long.prompt_tokens) + 200  # (grows)
    with pytest.raises(SystemExit, match="window:K"):
        Context.parse("window:0")
    with pytest.raises(SystemExit, match="window:K"):
        Context.parse("windows:3")
    assert str(Context.parse("window:3")) == "window:3" and not Context.parse("full").segmented


def test_a_windowed_episode_counts_once_however_its_segments_fall_into_micro_and_mini_batches():
    """The weighting rule (rl/context.py): with terms equal to each episode's own constant on its action tokens,
    seq-mean-token-mean gives the mean of the constants, seq-mean-token-sum the mean of constant x the episode's
    action tokens, token-mean their sum over all action tokens: as if each episode were one row, whatever its
    segments and wherever they fall (a row a micro-batch, every other row in each of two mini-batches)."""
    import torch

    from rl.batch import count_sequences, make_batch, rows_of
    from rl.losses import aggregate

    fmt, _, played = window_episodes("babyai", k=1, horizon=6, task_ids=LONG)
    assert max(len(t.sequences) for t in played) >= 3
    rows, episodes = rows_of(played)
    batch = make_batch(rows, fmt.pad_id, [[[i]] for i in range(len(rows))], "cpu", episodes=episodes)
    constants = torch.tensor([1.0, 3.0, -2.0])
    tokens = torch.tensor([float(sum(sum(s[1]) for s in t.sequences)) for t in played])
    expected = {"seq-mean-token-mean": constants.mean(), "seq-mean-token-sum": (constants * tokens).mean(),
                "token-mean": (constants * tokens).sum() / tokens.sum()}
    counts = (sum(float(m.loss_mask.sum()) for m in batch.micro), count_sequences(batch.micro))
    for mode, value in expected.items():  # (a micro-batch a row: an episode's segments in several)
        total = sum(float(aggregate(constants[m.segments.clamp(min=0)] * (m.segments >= 0), m.loss_mask, mode,
                                    *counts, m.segments, m.weights)) for m in batch.micro)
        assert total == pytest.approx(float(value), rel=1e-5), mode
    halves = [batch.micro[0::2], batch.micro[1::2]]  # (two mini-batches, an episode's segments in both)
    assert all(len({int(e) for m in half for e in m.segments.unique() if e >= 0}) > 1 for half in halves)
    assert sum(count_sequences(half) for half in halves) == pytest.approx(len(played))
    assert count_sequences(batch.micro) == pytest.approx(len(played))


def context_run(tmp_path, context, *flags):
    """One training step of train.py under `context` on BabyAI's long episodes (LONG), then eval.py on two of them
    from its checkpoint: the rollout records, the step's metrics and the eval results."""
    import json

    import eval as eval_script
    import train
    from rl.flags import build

    task_file = tmp_path / "long.json"
    task_file.write_text(json.dumps([{"item_id": f"babyai_{t}"} for t in LONG]))
    args = train.parse_args(["--env", "babyai", "--steps", "1", "--tasks-per-step", "3", "--n", "2", "--horizon", "5",
                             "--max-new-tokens", "24", "--context", context, "--train-tasks", str(task_file),
                             "--eval-every", "0", "--out-dir", str(tmp_path), "--run-name", "context", *flags])
    run_dir = train.main(args)
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    results = eval_script.main(build(eval_script.Args, model=str(run_dir / "checkpoints" / "step_1"), limit=2, k=1,
                                     tasks=str(task_file), horizon=(5,), out=str(tmp_path / "eval")))
    assert metrics["losses/nonfinite_updates"] == 0 and metrics["rollout/action_tokens"] > 0
    assert metrics["rollout/segments"] > 1 and results["context"] == context
    return records, metrics, results


@pytest.mark.slow
def test_a_windowed_run_trains_its_segments_logs_them_and_its_checkpoint_plays_the_same_window(tmp_path):
    """train.py --context window:1 with GiGPO (turn-level groups across segments) on the HF engine: the step trains,
    the metrics say segments and the prompts' sizes, and eval.py plays the checkpoint under the run's own window."""
    records, metrics, results = context_run(tmp_path, "window:1", "--algo", "gigpo")
    assert max(r["segments"] for r in records) >= 3 and all(len(r["prompt_tokens"]) == r["turns"] for r in records)
    assert metrics["rollout/prompt_tokens_max"] == max(max(r["prompt_tokens"]) for r in records)
    assert results["prompt_tokens_max"] > 0


def test_a_model_behind_an_api_is_sent_the_window_not_the_episode():
    """A text engine renders nothing here: under --context window its requests carry the opening and the kept turns
    (Trajectory.prompt_messages), as a local model's prompt would."""
    from rl.context import Context, Kept
    from rl.engines.api import APIEngine
    from rl.trajectory import Trajectory
    from tests.test_api_eval import fake_api, reply, turns

    messages = [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "OK."},
                {"role": "user", "content": "Room 0."}]
    for k in range(1, 4):
        messages += [{"role": "assistant", "content": f"Action: go {k}"}, {"role": "user", "content": f"Room {k}."}]
    traj = Trajectory("babyai", 0, 0, 0, messages, context=Kept(3, messages[:3], 7))
    assert traj.prompt_messages() == messages[:3] + messages[7:]
    with fake_api(lambda body, attempt, authorization: reply()) as (url, seen):
        engine = APIEngine(url, "fake-model", retries=0)
        try:
            turns(engine, [traj])
        finally:
            engine.close()
    (_, body, _), = seen
    assert body["messages"] == messages[:3] + messages[7:]
    from rl.engines import Sample
    from rl.engines.api import APIFormat
    from rollout import _act

    _act(APIFormat(), Context.parse("window:2"), traj, Sample([], text="Action: go 4", usage={"prompt_tokens": 321}))
    assert traj.prompt_tokens == [321]  # (its prompt as the server counted it: nothing is tokenized here)


@pytest.mark.slow
@pytest.mark.parametrize("crossing", ["drop", "tools"])
def test_a_window_crosses_reasoning_drop_and_tool_calls_token_exact(crossing):
    """--reasoning drop under a window renders each turn from the kept messages alone; --agent tools keeps whole
    calls and their results in the window (TextCraft's tools), every segment rendered with the tools."""
    if crossing == "drop":
        fmt, spy, played = window_episodes("babyai", k=2, horizon=6, task_ids=LONG[:2], reasoning="drop")
        assert check_window(fmt, spy, played, 2, every=True) >= 10
    else:
        fmt, spy, played = window_episodes("textcraft", k=1, horizon=6, task_ids=[36, 38, 49],
                                           agent="tools")  # (test tasks of 3 turns)
        assert all(t.tools for t in played) and min(len(t.sequences) for t in played) == 2
        assert all(m.get("role") == "tool" for t in played for m in t.prompt_messages()[4::2])
        assert check_window(fmt, spy, played, 1) == 9


# ----------------------------------------------------------------------------------------------
# --context summary:M: a summary turn after every M-th turn, which replaces the turns before it


def check_summary(fmt, spy, trajectories, m):
    """Every sampled turn's prompt: the first prompt; after an action, the last prompt plus the sampled tokens and the
    env's answer (after every M-th turn with the request on it); after a summary, the template's rendering of the
    opening, the summary and the env's last answer without the request. Summaries come after env turns M, 2M, ...,
    count for no env turn, and are trained like any turn."""
    from rl.context import SUMMARY_REQUEST

    checked = 0
    for traj in trajectories:
        prompts, samples, opening = spy.prompts[traj.row], spy.samples[traj.row], traj.context.opening
        messages = traj.messages[opening:]
        at, turns, summary_of = 0, 0, None  # (the sample's assistant message, env turns so far, the last answer)
        for k, prompt in enumerate(prompts):
            if k == 0:
                assert prompt == fmt.prompt(traj.messages[:opening], tools=traj.tools)
            elif summary_of is not None:
                kept = traj.messages[:opening] + [messages[at - 1], summary_of]
                assert prompt == fmt.prompt(kept, tools=traj.tools), (traj.env, k)
                summary_of = None
            else:
                closed = samples[k - 1] + ([] if samples[k - 1][-1:] == [fmt.end_of_turn] else [fmt.end_of_turn])
                answer = messages[at - 1]
                assert prompt == prompts[k - 1] + closed + fmt.observation(answer["content"], answer["role"])
            summarizing = k in traj.summary_spans
            assert messages[at]["role"] == "assistant"
            if summarizing:  # (after env turns M, 2M, ...: its prompt ends with the request)
                assert turns % m == 0 and turns > 0 and messages[at - 1]["content"].endswith(SUMMARY_REQUEST)
                summary_of = {**messages[at - 1], "content": messages[at - 1]["content"][:-len(SUMMARY_REQUEST) - 2]}
                at += 1
            else:
                turns += 1
                at += 2
            checked += 1
        assert turns == traj.turns and len(traj.summary_spans) == (traj.turns - 1) // m
        trained = [t for ids, mask, _ in traj.sequences for t, x in zip(ids, mask) if x]
        assert trained == [t for s in samples for t in s]  # (every sampled turn, the summaries too, trained once)
        assert len(traj.sequences) == 1 + len(traj.summary_spans)
    return checked


@pytest.mark.slow
@pytest.mark.parametrize("name", envs.ENVS)
def test_summaries_replace_the_turns_before_them_token_exact_on_every_env(name):
    from rl.agent import make_agent
    from rl.context import Context
    from rollout import ExpertEngine

    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    task_ids = LONG[:2] if name == "babyai" else envs.splits(name)["test"][:2]
    environments = [envs.make(name) for _ in task_ids]
    engine = ExpertEngine(fmt, environments)
    engine.expert_texts = []
    spy = Spy(engine, fmt)
    try:
        played = rollout(spy, fmt, environments, task_ids, [0, 1], horizon=6, max_new_tokens=256, max_tokens=16384,
                         agent=make_agent("react", 1, Context.parse("summary:2")))
    finally:
        for env in environments:
            env.close()
    assert all(t.error is None or "expert failed" in t.error for t in played)
    assert check_summary(fmt, spy, played, 2) >= 2
    if name == "babyai":  # (long episodes: 6 env turns, summaries after turns 2 and 4)
        assert [t.turns for t in played] == [6, 6] and all(t.summary_spans == [2, 5] for t in played)


def test_a_summarys_tokens_count_as_the_turn_they_precede_and_keep_their_own_version():
    """GiGPO's turns: a summary's tokens belong to the env turn that follows it (the state it was written in); the
    policy versions (--max-staleness) go by sampled turn, summaries counted; over an episode's segments (rows_of,
    batch turns) the env turns run on without a gap."""
    from rl.batch import rows_of, turns
    from rl.trajectory import Trajectory

    ids, mask = [9, 1, 1, 9, 2, 9, 3, 3, 9, 4], [0, 1, 1, 0, 1, 0, 1, 1, 0, 1]  # (sampled: a0, a1, S, a2)
    traj = Trajectory("babyai", 0, 0, 0, [], token_ids=ids, loss_mask=mask, logprobs=[0.0] * 10, turns=3,
                      summary_spans=[2], versions=[5, 5, 6, 7])
    assert traj.token_turns() == [-1, 0, 0, -1, 1, -1, 2, 2, -1, 2]
    assert traj.token_versions() == [-1, 5, 5, -1, 5, -1, 6, 6, -1, 7]
    traj.sequences = [(ids[:8], mask[:8], [0.0] * 8), ([8, 9, 4], [0, 0, 1], [0.0] * 3)]
    rows, episodes = rows_of([traj])
    assert [r.summary_spans for r in rows] == [[2], []] and [r.versions for r in rows] == [[5, 5, 6], [7]]
    assert turns(rows, episodes, 8).tolist() == [[-1, 0, 0, -1, 1, -1, 2, 2], [-1, -1, 2, -1, -1, -1, -1, -1]]


@pytest.mark.slow
def test_a_summarizing_run_trains_and_its_checkpoint_plays_the_same_context(tmp_path):
    """train.py --context summary:2 with GiGPO on vLLM under the asynchronous loop (a summary's tokens with their own
    policy version and the env turn they precede)."""
    records, _, _ = context_run(tmp_path, "summary:2", "--algo", "gigpo", "--engine", "vllm", "--max-staleness", "1")
    long = [r for r in records if r["turns"] > 2]
    assert long and all(r["summaries"] == (r["turns"] - 1) // 2 and r["segments"] == 1 + r["summaries"] for r in long)
    assert all(len(r["prompt_tokens"]) == r["turns"] + r.get("summaries", 0) for r in records)


def test_the_viewer_replays_summarized_and_cut_episodes_and_a_cut_episode_counts_what_it_kept():
    """An episode with summaries and cut observations replays on its env without diverging (the viewer pairs each
    env action with its answer, skips summaries, strips the request and compares around a cut); Trajectory.cut
    (eval's turn sweep) keeps the prompts, observations and summaries of the turns it keeps."""
    import sys as _sys
    from pathlib import Path

    from rl.agent import make_agent
    from rl.context import Context
    from rollout import ExpertEngine

    _sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import view

    fmt = ChatFormat(load_tokenizer("tiny-agent"), max_obs_tokens=24)
    environments = [envs.make("babyai")]
    try:
        traj, = rollout(ExpertEngine(fmt, environments), fmt, environments, LONG[1:2], [0], horizon=7,
                        max_new_tokens=256, max_tokens=16384, agent=make_agent("react", 1, Context.parse("summary:2")))
    finally:
        environments[0].close()
    assert traj.turns == 7 and traj.summary_spans == [2, 5, 8] and traj.obs_cut >= 4
    state = view.replay(traj.log_record() | {"item_id": f"babyai_{LONG[1]}"}, {})
    assert state["diverged"] is None and len(state["states"]) == traj.turns + 1
    short = traj.cut(3)  # (turns 1-3 and the summary after turn 2: 4 sampled turns, 4 observations)
    assert (short.turns, len(short.prompt_tokens), short.summary_spans, short.observations) == (3, 4, [2], 4)
    assert short.prompt_tokens == traj.prompt_tokens[:4] and set(short.cut_at) <= {0, 1, 2, 3}


def test_after_a_summary_a_tool_result_is_kept_as_the_users_message():
    """--agent tools: the env's last answer was a tool result, whose call leaves with the summarized turns; the next
    prompt holds it as a user message (a tool message answering no call is refused by API servers)."""
    from rl.agent import make_agent
    from rl.context import Context
    from rollout import ExpertEngine

    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    environments = [envs.make("textcraft") for _ in range(2)]
    try:
        played = rollout(ExpertEngine(fmt, environments), fmt, environments, [36, 38], [0, 1], horizon=3,
                         max_new_tokens=256, max_tokens=16384, agent=make_agent("tools", 1, Context.parse("summary:1")))
    finally:
        for env in environments:
            env.close()
    for traj in played:
        assert traj.summary_spans and traj.error is None
        kept = traj.context.head
        assert kept[-2]["role"] == "assistant" and not kept[-2].get("tool_calls") and kept[-1]["role"] == "user"


def test_context_flags_take_only_what_they_mean():
    from rl.context import Context

    for spec in ("full:3", "summary", "summary:0", "window:-1", "window:x"):
        with pytest.raises(SystemExit, match="--context takes full"):
            Context.parse(spec)
    fmt = ChatFormat(load_tokenizer("tiny-agent"), max_obs_tokens=16)
    for text in ("🦜" * 16, "漢字" * 8):  # (16 characters, more tokens: a byte-level BPE's token holds a byte at least)
        cut, over = fmt.cut(text)
        assert over > 0 and len(fmt.encode(cut.split("[...")[0])) <= 9
