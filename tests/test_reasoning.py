"""Reasoning models (rl/chat.py: Reasoning, ChatFormat.answer): the env receives only the reply after its reasoning
block (after the last closing tag), a decoy "Action:" inside the block changes nothing, a reply cut off inside its
block is an invalid action with an observation that says so, the tags come from the template (or the default
pair, or the flag), template options reach every rendering, a whole episode of a model that thinks stays
token-exact (--reasoning keep), and under DeepSeek-R1-Distill's own template, whose generation prompt opens the
block, the HF engine's replies hold only the closing tag and are read the same way."""

import copy
import re

import pytest
import torch

import envs
from rl.agent import REACT, make_agent
from rl.chat import DEFAULT_REASONING, ChatFormat, Reasoning, reasoning_of
from rl.context import Context
from rl.engines import Sample
from rl.engines.expert import ExpertEngine
from rl.engines.hf import HFEngine
from rl.model import load_tokenizer
from rollout import rollout
from test_token_exactness import Spy, check_exact

DROP = make_agent("react", 1, Context.parse("full", "drop"))  # --reasoning drop
DECOY = "<think>\nThe goal is near. Action: turn left would be wrong here.\n</think>\n\n"


@pytest.fixture(scope="module")
def thinking(real_tokenizer):
    return ChatFormat(real_tokenizer("qwen3"))  # Qwen3's own template and tokenizer


def test_the_answer_is_what_follows_the_reasoning_block():
    tags = Reasoning(*DEFAULT_REASONING)
    assert tags.split(DECOY + "Action: go forward") == (DECOY[len("<think>"):DECOY.index("</think>")],
                                                        "Action: go forward")
    assert tags.split("  <think>a</think>Action: x") == ("a", "Action: x")  # leading space before the block
    assert tags.split("Action: x <think>not closed") == ("", "Action: x <think>not closed")  # no block at the start
    assert tags.split("<think>cut off before the end Action: y") == ("cut off before the end Action: y", None)
    # a generation prompt that opened the block: the reply starts inside it, and holds only the closing tag
    assert tags.split("a thought</think>\nAction: z", opened=True) == ("a thought", "Action: z")
    assert tags.split("no end", opened=True) == ("no end", None)
    # (as a server without a reasoning parser returns such a reply, where the prompt is not known to open the block)
    assert tags.split("a thought</think>\nAction: z") == ("a thought", "Action: z")
    assert tags.split("no tag at all") == ("", "no tag at all")
    # the answer is what follows the last closing tag, however many the reasoning wrote
    assert tags.split("<think>a</think>b</think>c") == ("a</think>b", "c")
    assert tags.split("a</think>b</think>\nc", opened=True) == ("a</think>b", "c")
    assert tags.split("Action: x <think>a block at the end</think>") == ("Action: x <think>a block at the end", "")
    # a block opened after the last closing tag and never closed: cut off inside it
    assert tags.split("<think>a</think>\n<think>b") == ("a</think>\n<think>b", None)


def test_a_closing_tag_inside_a_tool_call_is_the_calls_text_not_the_end_of_the_reasoning():
    """A call's argument may hold the closing tag as text (a query about "</think>"): the reasoning ends at the last
    closing tag outside every <tool_call> block, so the env gets the call whole, and a calling turn is rendered
    without it (without_calls) with its reasoning."""
    from rl.agent import make_agent
    from rl.chat import without_calls
    from rl.engines.api import APIFormat

    tags = Reasoning(*DEFAULT_REASONING)
    call = '<tool_call>{"name": "search", "arguments": {"query": "what does </think> close"}}</tool_call>'
    assert tags.split("<think>r</think>\n" + call) == ("r", call)
    assert tags.split("r</think>\n" + call, opened=True) == ("r", call)
    cut = '<tool_call>{"name": "search", "arguments": {"query": "</think>'  # (cut off inside the call)
    assert tags.split("<think>r</think>" + cut) == ("r", cut)
    thought = '<think>a call I may make: <tool_call>{"q": "</think>"}</tool_call>, or a <tool_call> tag</think>'
    assert tags.split(thought + call) == (thought[len("<think>"):-len("</think>")], call)
    mention = "<think>Should I answer with a <tool_call> block? No, plain text.</think>\nAction: go forward"
    assert tags.split(mention) == ("Should I answer with a <tool_call> block? No, plain text.", "Action: go forward")
    assert without_calls("<think>r</think>\n" + call, "hermes", tags) == "<think>r</think>"
    action = make_agent("tools").read(APIFormat(), "searchqa", "<think>r</think>\n" + call)
    assert action.problem is None and action.text == "<search>what does </think> close</search>"


def test_tags_come_from_the_template_the_default_pair_or_the_flag(thinking):
    assert thinking.reasoning == Reasoning("<think>", "</think>")
    assert ChatFormat(load_tokenizer("tiny-agent")).reasoning is None  # a template that names no tags: replies read whole
    assert ChatFormat(load_tokenizer("tiny-agent")).answer("<think>x</think>y") == "<think>x</think>y"
    assert reasoning_of(None) == Reasoning(*DEFAULT_REASONING)  # no template to read: an API model
    assert reasoning_of("{{ '</thinking>' }}") == Reasoning("<thinking>", "</thinking>")
    flagged = ChatFormat(load_tokenizer("tiny-agent"), reasoning_tags=("<reason>", "</reason>"))
    assert flagged.answer("<reason>r</reason>Action: a") == "Action: a"


def test_template_options_reach_every_rendering(thinking):
    """enable_thinking=false (Qwen3): the generation prompt closes an empty block, so replies carry no reasoning,
    and the first prompt and every observation's scaffolding end with it."""
    plain, closed = thinking, ChatFormat(thinking.tokenizer, template_kwargs={"enable_thinking": False})
    empty = "<think>\n\n</think>\n\n"
    assert not plain.observation_suffix.endswith(empty) and closed.observation_suffix.endswith(empty)
    messages = [{"role": "user", "content": "hello"}]
    assert closed.tokenizer.decode(closed.prompt(messages)).endswith("assistant\n" + empty)
    assert not plain.opens_reasoning and not closed.opens_reasoning
    assert closed.answer("Action: go") == "Action: go"


def test_a_template_that_opens_the_block_makes_replies_start_inside_it(real_tokenizer):
    tokenizer = real_tokenizer("qwen3_thinking_2507")  # (R1 distills' opens it too: tests/test_templates.py)
    fmt = ChatFormat(tokenizer)
    assert fmt.observation_suffix.endswith("<think>\n") and fmt.opens_reasoning
    assert fmt.answer("thinking about it\n</think>\n\nAction: go forward") == "Action: go forward"
    assert fmt.answer("Action: not yet closed") is None


class Thinking(ExpertEngine):
    """The envs' experts, thinking before every reply, with a decoy "Action:" inside their reasoning; `cut` turns
    never close their block (as if --max-new-tokens ran out)."""

    def __init__(self, fmt, environments, cut=()):
        super().__init__(fmt, environments)
        self.cut, self.expert_texts = set(cut), []

    def generate(self, batch, limits):
        out = []
        for traj, sample in zip(batch, super().generate(batch, limits)):
            if sample.error is None:
                self.expert_texts.append(self.fmt.text(sample.token_ids[:-1]))  # (the expert's own text, tokenized once)
                text = DECOY + self.fmt.text(sample.token_ids)
                if traj.turns in self.cut:
                    text = DECOY[:DECOY.index("</think>")] + "still thinking"
                ids = self.fmt.encode(text) + [self.fmt.end_of_turn]
                self.expert_texts.append(text)
                sample = Sample(ids, [0.0] * len(ids))
            out.append(sample)
        return out


MULTI_TURN = [21, 34, 30, 0]  # BabyAI test tasks whose expert takes 4, 3, 2 and 1 turns


def play(fmt, engine_of, name="babyai", count=3, horizon=5, agent=REACT):
    task_ids = MULTI_TURN[:count] if name == "babyai" else envs.splits(name)["test"][:count]
    environments = [envs.make(name) for _ in range(count)]
    engine = engine_of(environments)
    engine.expert_texts = getattr(engine, "expert_texts", [])
    spy = Spy(engine, fmt)
    try:
        trajectories = rollout(spy, fmt, environments, task_ids, list(range(count)),
                               horizon=horizon, max_new_tokens=512, max_tokens=16384, agent=agent)
    finally:
        for env in environments:
            env.close()
    return spy, trajectories


@pytest.mark.parametrize("agent", ["react", "plan"])
def test_the_env_never_sees_the_reasoning_and_a_thinking_episode_is_token_exact(thinking, agent):
    """The experts play with a decoy "Action:" in their reasoning: the env acts exactly as without it (same rewards,
    turns, finishes, no invalid actions), the reasoning tokens are trained as sampled, and every turn's prompt is
    the last one's plus the sampled tokens plus the observation (keep)."""
    formats = make_agent(agent)
    _, plain = play(thinking, lambda environments: ExpertEngine(thinking, environments), agent=formats)
    spy, thought = play(thinking, lambda environments: Thinking(thinking, environments), agent=formats)
    assert [(t.reward, t.turns, t.finish, t.invalid_actions) for t in thought] == \
        [(t.reward, t.turns, t.finish, t.invalid_actions) for t in plain]
    assert sum(t.success for t in thought) == 3 and [t.turns for t in thought] == [4, 3, 2]
    check_exact(thinking, spy, thought, renders=False)
    for traj in thought:
        # what the template renders for the conversation at the last turn is the trajectory's own context without the
        # earlier turns' reasoning: the difference `keep` makes, on purpose
        last = spy.prompts[traj.row][-1]
        shown = thinking.render(traj.messages[:3 + 2 * (traj.turns - 1)], add_generation_prompt=True)
        assert re.sub(r"<think>.*?</think>\n\n", "", thinking.tokenizer.decode(last), flags=re.DOTALL) == shown
        assert len(last) - len(thinking.encode(shown)) == (traj.turns - 1) * len(thinking.encode(DECOY))
    for traj in thought:
        trained = thinking.tokenizer.decode([i for i, m in zip(traj.token_ids, traj.loss_mask) if m])
        assert trained.count("Action: turn left would be wrong") == traj.turns


def test_a_reply_cut_off_inside_its_reasoning_is_an_invalid_action(thinking):
    """Turn 0 never closes its block: the env is not stepped, the observation says why, the turn counts as invalid,
    and the episode goes on to the expert's next action, token-exact."""
    stepped = []

    def engine_of(environments):
        for env in environments:
            original = env.step
            env.step = lambda text, original=original: stepped.append(text) or original(text)
        return Thinking(thinking, environments, cut={0})

    spy, trajectories = play(thinking, engine_of, count=2, horizon=3)
    for traj in trajectories:
        assert traj.invalid_actions >= 1 and traj.finish in ("done", "horizon") and traj.error is None
        assert "ended inside its reasoning, before </think>" in traj.messages[4]["content"]
        assert traj.turn_rewards[0] == 0.0
    assert len(stepped) == sum(t.turns - 1 for t in trajectories)  # the cut turns never reached an env
    assert not any("still thinking" in text or "would be wrong" in text for text in stepped)
    check_exact(thinking, spy, trajectories, renders=False)


def test_drop_lays_each_turn_out_as_the_template_renders_it_token_exact(thinking):
    """--reasoning drop: every turn's prompt is the template's rendering of the conversation before it (earlier
    reasoning gone), followed by exactly the sampled tokens, trained on alone; the episode's sequences are its turns."""
    spy, trajectories = play(thinking, lambda environments: Thinking(thinking, environments), agent=DROP)
    assert any(t.turns >= 2 for t in trajectories)
    for traj in trajectories:
        assert len(traj.sequences) == traj.turns == len(spy.prompts[traj.row])
        for k, (ids, mask, _) in enumerate(traj.sequences):
            prompt, sample = spy.prompts[traj.row][k], spy.samples[traj.row][k]
            assert prompt == thinking.prompt(traj.messages[:3 + 2 * k])  # what the template renders, earlier reasoning gone
            assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(sample)] == sample
            assert [t for t, m in zip(ids, mask) if m] == sample and not any(mask[:len(prompt)])
            assert thinking.tokenizer.decode(prompt).count("<think>") == 0  # (the template shows reasoning after the last user turn only)
        assert traj.token_ids == traj.sequences[-1][0]
        record = traj.log_record()
        assert record["segments"] == traj.turns and record["action_tokens"] == sum(map(len, spy.samples[traj.row]))


@pytest.mark.slow  # (two training steps a layout)
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_drop_trains_an_episode_as_keep_does_where_the_template_drops_nothing(aggregation, tmp_path):
    """On a template that renders history as it was sampled (the embedded agent's) the two layouts score every action
    token in the same context, so one GRPO optimizer step must be the same: advantages per episode, not per turn row,
    and each episode weighing the same whether it is one row or one row a turn, however the rows fall into
    micro-batches (2 rows each here, so an episode's turns are split)."""
    from accelerate import Accelerator

    import train
    from rl.batch import attach
    from rl.model import build_models
    from test_batch import one_update

    accelerator = Accelerator(cpu=True)
    gradients, losses, counts = {}, {}, {}
    for history in ("keep", "drop"):
        fmt = ChatFormat(load_tokenizer("tiny-agent"))
        _, played = play(fmt, lambda environments: ExpertEngine(fmt, environments), count=4, horizon=3,
                         agent=make_agent("react", 1, Context.parse("full", history)))
        for k, traj in enumerate(played):  # outcomes that differ within each group of two
            traj.reward, traj.group = [0.0, 1.0, 0.3, 0.9][k], k // 2
        counts[history] = [t.turns for t in played]
        args = train.parse_args(["--tasks-per-step", "2", "--n", "2", "--minibatches", "1", "--kl-coef", "0",
                                 "--micro-batch-size", "2", "--loss-agg", aggregation, "--reasoning", history,
                                 "--out-dir", str(tmp_path)])
        torch.manual_seed(0)
        models = build_models(accelerator, args.model, args.model, args.algo, args.objective.kl_coef, args.model_args)
        batch = train.batch_of(played, args, accelerator, fmt.pad_id)
        assert len(batch.full.loss_mask) == (sum(counts[history]) if history == "drop" else len(played))
        train.old_logprobs(models, batch, args, accelerator)
        advantages, _ = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, None, batch.episodes)
        attach(batch, advantages, None)
        losses[history], gradients[history] = one_update(models, batch, args, accelerator)
        accelerator.free_memory()
    assert counts["drop"] == counts["keep"] and max(counts["keep"]) >= 2  # (an episode of several turns, split in rows)
    assert losses["drop"] == pytest.approx(losses["keep"], rel=1e-5)
    for name, gradient in gradients["keep"].items():
        torch.testing.assert_close(gradients["drop"][name], gradient, rtol=1e-3, atol=1e-5 * float(gradient.abs().max()),
                                   msg=lambda message, name=name: f"{name}: {message}")


def test_an_episode_split_over_mini_batches_counts_once():
    """--reasoning drop with several mini-batches: an episode's turn rows may fall into different ones; each counts
    the share of the episode's action tokens it holds, so that over the mini-batches every episode counts once."""
    from rl.batch import count_sequences, make_batch, rows_of

    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    _, played = play(fmt, lambda environments: ExpertEngine(fmt, environments), count=4, horizon=3, agent=DROP)
    rows, episodes = rows_of(played)
    batch = make_batch(rows, fmt.pad_id, [[[i]] for i in range(len(rows))], "cpu", episodes=episodes)  # a row each
    halves = [batch.micro[0::2], batch.micro[1::2]]  # (every other row: an episode's turns in both)
    assert all(len({int(e) for m in half for e in m.segments.unique() if e >= 0}) > 1 for half in halves)
    assert sum(count_sequences(half) for half in halves) == pytest.approx(len(played))
    assert count_sequences(batch.micro) == pytest.approx(len(played))


# ----------------------------------------------------------------------------------------------
# In process, on a template whose generation prompt opens the block (DeepSeek-R1-Distill's own): every reply starts
# inside it and holds only the closing tag


WRONG = "Action: go forward? No.\n"  # (a decoy the env must not see)
R1_TURNS = [WRONG + "</think>\n\nThought: I look.\nAction: turn left",  # one closing tag
            "I wrote </think> here. " + WRONG + "</think>\n\nAction: turn right",  # several
            WRONG + "Still thinking"]  # cut off inside the reasoning: no closing tag


@pytest.fixture(scope="module")
def r1():
    """The tiny model and tokenizer speaking DeepSeek-R1-Distill's real chat template (set-up fetches it, sha256-pinned:
    rl/artifacts.py), its special tokens added and the embeddings resized."""
    from rl import artifacts
    from rl.model import load_model

    template = artifacts.path("templates/deepseek_r1_distill.jinja").read_text()
    tokenizer = copy.deepcopy(load_tokenizer("tiny-agent"))
    tokenizer.chat_template = template
    tokenizer.add_special_tokens({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                  "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
    model = load_model("tiny-agent")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return tokenizer, model


class Forced(HFEngine):
    """The HF engine on the tiny model, every row's draws replaced by the tokens of R1_TURNS[its turn] (the model
    still runs on them and the log-probs are its own): chosen replies, sampled through the engine's own loop."""

    expert_texts = R1_TURNS  # (the texts it tokenizes: check_exact allows them)

    def generate(self, batch, limits):
        self.forced, self.step = [self.fmt.encode(R1_TURNS[traj.turns]) + [self.fmt.end_of_turn] for traj in batch], 0
        return super().generate(batch, limits)

    def _sample(self, logits):  # logits: [rows, vocab]
        token = torch.tensor([ids[min(self.step, len(ids) - 1)] for ids in self.forced])
        self.step += 1
        return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


@pytest.mark.parametrize("history", ["keep", "drop"])
def test_a_template_that_opens_the_block_gives_the_env_the_text_after_the_last_closing_tag(r1, history):
    """Turn 1: reasoning with a decoy "Action:", </think>, the answer; turn 2: </think> written inside the reasoning
    too (the answer follows the last one); turn 3: cut off inside the reasoning (an invalid action, the env not
    stepped). The tokens are the sampled ones; the conversation renders each reply as the text the env read."""
    tokenizer, model = r1
    fmt = ChatFormat(tokenizer)
    assert fmt.opens_reasoning and fmt.observation_suffix == "<｜Assistant｜><think>\n"
    stepped = []
    environments = [envs.make("babyai") for _ in range(2)]
    for env in environments:
        env.step = lambda text, original=env.step: stepped.append(text) or original(text)
    spy = Spy(Forced(model, fmt), fmt)
    try:
        trajectories = rollout(spy, fmt, environments, MULTI_TURN[:2], [0, 1], horizon=3, max_new_tokens=128,
                               max_tokens=4096, agent=make_agent("react", 1, Context.parse("full", history)))
    finally:
        for env in environments:
            env.close()
    answers = ["Thought: I look.\nAction: turn left", "Action: turn right"]
    assert stepped == [answers[0]] * 2 + [answers[1]] * 2
    for traj in trajectories:
        assert (traj.turns, traj.finish, traj.invalid_actions, traj.malformed) == (3, "horizon", 1, 1)
        assert traj.actions == [*answers, None]
        assert "ended inside its reasoning, before </think>" in traj.messages[-1]["content"]
        samples = spy.samples[traj.row]
        assert samples == [fmt.encode(text) + [fmt.end_of_turn] for text in R1_TURNS]  # the tokens as sampled
        assert [m["content"] for m in traj.messages[3::2]] == R1_TURNS  # the conversation keeps the replies whole
        # and renders each closed one as the text the env read (the template drops everything up to the last
        # </think>; a reply cut off inside its reasoning it renders as it is, as a server does)
        shown = fmt.render(traj.messages[:7], add_generation_prompt=True)
        replies = re.findall("<｜Assistant｜>(.*?)<｜end▁of▁sentence｜>", shown, re.DOTALL)[1:]  # (after the ack)
        assert [reply.lstrip() for reply in replies] == answers and WRONG not in shown
        if history == "drop":  # each turn's prompt: that rendering of the conversation before it
            assert spy.prompts[traj.row] == [fmt.prompt(traj.messages[:3 + 2 * k]) for k in range(3)]
            assert [[t for t, m in zip(ids, mask) if m] for ids, mask, _ in traj.sequences] == samples  # (trained on)
    if history == "keep":
        check_exact(fmt, spy, trajectories, renders=False)
