"""Agent formats (rl/agent.py): react lays episodes out as before, plan's plans are sampled and trained but never
reach the env, reflect carries each failed attempt's reflection into the next attempt and stops at a success;
every format's rollouts stay token-exact on every env."""

import importlib.util
import json
from pathlib import Path

import pytest

import envs
from rl.agent import PLAN_GUIDE, REACT, REFLECT_ASK, REFLECTIONS, make_agent
from rl.engines import RoundEngine, Sample
from rl.engines.expert import ExpertEngine
from rl.model import load_model, load_tokenizer
from rollout import ATTEMPT_GROUPS, ChatFormat, HFEngine, RolloutStats, rollout
from test_token_exactness import Spy, check_exact

PLAN = "<plan>\n1. look around\n2. Action: do the task step by step\n</plan>\n"  # holds "Action:": the env must not see it


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(load_tokenizer("tiny-agent"))


def ported(name):
    if importlib.util.find_spec(f"envs.{name}") is None:
        pytest.skip(f"envs.{name} is not ported yet")


@pytest.mark.parametrize("name", envs.ENVS)
def test_react_is_agentgyms_layout_byte_for_byte(name):
    ported(name)
    env = envs.make(name)
    try:
        assert REACT.opening(env, "the first observation") == [
            {"role": "user", "content": env.instruction}, {"role": "assistant", "content": env.ack},
            {"role": "user", "content": "the first observation"}]
        assert REACT.env_text("Thought:\nx\n\nAction:\ny") == "Thought:\nx\n\nAction:\ny"
        assert make_agent("reflect", 3).opening(env, "o") == REACT.opening(env, "o")  # no reflections yet
    finally:
        env.close()


def test_plan_text_is_removed_before_the_env_reads_the_reply():
    plan = make_agent("plan")
    assert plan.env_text(PLAN + "Thought:\nt\n\nAction:\ngo forward") == "Thought:\nt\n\nAction:\ngo forward"
    assert plan.env_text("Thought:\nt\n\nAction:\nturn left") == "Thought:\nt\n\nAction:\nturn left"  # no new plan
    assert plan.env_text("<plan>never closed Action: x") == ""  # a malformed reply: nothing to act on
    assert plan.env_text("<plan>a</plan><plan>b</plan>Action: y") == "Action: y"
    assert plan.env_text("<PLAN>Action: x</Plan>\nAction: y") == "Action: y"  # any case
    with pytest.raises(ValueError, match="unknown agent format"):
        make_agent("tree-of-thought")
    with pytest.raises(ValueError, match="at least 1"):
        make_agent("reflect", 0)


class Planning(ExpertEngine):
    """The envs' experts, writing a plan before their first action and a revision at their third."""

    def __init__(self, fmt, environments):
        super().__init__(fmt, environments)

    def generate(self, batch, limits):
        samples = super().generate(batch, limits)
        out = []
        for traj, sample in zip(batch, samples):
            if sample.error is None and traj.turns in (0, 2):
                text = PLAN + self.fmt.text(sample.token_ids)
                ids = self.fmt.encode(text) + [self.fmt.end_of_turn]
                self.expert_texts.append(text)
                sample = Sample(ids, [0.0] * len(ids))
            out.append(sample)
        return out


@pytest.mark.slow
@pytest.mark.parametrize("name", envs.ENVS)
def test_plan_rollouts_are_token_exact_and_the_env_acts_as_under_react(fmt, name):
    """The experts' plays with a plan in their replies: the same actions reach the env (same rewards, turns
    and finishes as without plans), the plan tokens are the sampled ones under the loss mask, and the tokens
    are exactly the sampled ones and the observations' (test_token_exactness.check_exact)."""
    ported(name)
    test_ids = envs.splits(name)["test"][:2]
    outcomes = {}
    for agent in (REACT, make_agent("plan")):
        environments = [envs.make(name) for _ in test_ids]
        engine = Planning(fmt, environments) if agent.name == "plan" else ExpertEngine(fmt, environments)
        engine.expert_texts = []
        spy = Spy(engine, fmt)
        original = engine.experts

        class Recording(dict):  # the expert's own text is new text, tokenized once (as test_token_exactness)
            def __setitem__(self, row, expert):
                def act(observation):
                    engine.expert_texts.append(text := expert(observation))
                    return text
                super().__setitem__(row, act)

        engine.experts = Recording(original)
        try:
            trajectories = rollout(spy, fmt, environments, test_ids, list(range(len(test_ids))), horizon=4,
                                   max_new_tokens=512, max_tokens=16384, agent=agent)
        finally:
            for env in environments:
                env.close()
        assert sum(t.turns for t in trajectories) >= 2
        check_exact(fmt, spy, trajectories)
        outcomes[agent.name] = [(t.reward, t.turns, t.finish, t.invalid_actions) for t in trajectories]
        if agent.name == "plan":
            for traj in trajectories:
                assert PLAN_GUIDE in traj.messages[0]["content"]
                trained = fmt.tokenizer.decode([i for i, m in zip(traj.token_ids, traj.loss_mask) if m])
                assert trained.count("<plan>") == min(traj.turns, 1) + (traj.turns >= 3)
    assert outcomes["plan"] == outcomes["react"]


class Scripted(RoundEngine):
    """A policy that wins a task only once it holds a reflection from its second attempt, and reflects
    with the attempt's number."""

    def __init__(self, fmt):
        super().__init__()
        self.fmt, self.asks = fmt, []

    def generate(self, batch, limits):
        samples = []
        for traj, limit in zip(batch, limits):
            last = traj.messages[-1]["content"]
            if REFLECT_ASK in last:
                self.asks.append((list(traj.token_ids), last))
                text = f"I lost {last.split()[0]} times"
            else:
                text = "Action: win" if "Attempt 2:" in traj.messages[0]["content"] else "Action: lose"
            ids = (self.fmt.encode(text) + [self.fmt.end_of_turn])[:limit]
            samples.append(Sample(ids, [0.0] * len(ids)))
        return samples


class WinOrLose(envs.Env):
    name, instruction, ack = "win-or-lose", "Say win.", "OK."

    def reset(self, task_id):
        self.plays = 0
        return "0 tries"

    def step(self, text):
        self.plays += 1
        won = "win" in text
        return envs.StepResult(f"{self.plays}" + (" won" if won else " lost"), float(won), won or self.plays >= 2,
                               {"success": won})


@pytest.mark.parametrize("attempts", [1, 2, 3, 5])
def test_reflect_carries_reflections_into_the_next_attempt_and_stops_at_success(fmt, attempts):
    engine, stats = Scripted(fmt), RolloutStats()
    environments = [WinOrLose() for _ in range(3)]
    trajectories = rollout(engine, fmt, environments, [7, 8, 9], [0, 1, 2], horizon=4, max_new_tokens=32,
                           max_tokens=4096, agent=make_agent("reflect", attempts), stats=stats)
    played = min(attempts, 3)  # the third attempt (holding attempt 2's reflection) wins, and is the last
    assert len(trajectories) == 3 * played
    for attempt in range(1, played + 1):
        these = [t for t in trajectories if t.attempt.number == attempt]
        assert [t.task_id for t in these] == [7, 8, 9]
        assert [t.group for t in these] == [g + ATTEMPT_GROUPS * (attempt - 1) for g in range(3)]  # a group per attempt
        for traj in these:
            assert traj.success == (attempt == 3) and traj.attempt.final == (attempt == played)
            assert traj.attempt.reflection == ("I lost 2 times" if attempt < played else None)
            first = traj.messages[0]["content"]
            if attempt == 1:
                assert first == "Say win."
            else:  # every earlier reflection, in order, after the instruction
                assert first == "Say win.\n\n" + REFLECTIONS + "\n".join(
                    f"Attempt {a}: I lost 2 times" for a in range(1, attempt))
            assert traj.token_ids[:len(fmt.prompt(traj.messages[:3]))] == fmt.prompt(traj.messages[:3])
    # a reflection continues its attempt's own tokens after the final observation and the request
    assert len(engine.asks) == 3 * (played - 1)
    reflected = len(engine.asks) * len(fmt.encode("I lost 2 times") + [fmt.end_of_turn])
    assert stats.sampled_tokens == sum(sum(t.loss_mask) for t in trajectories) + reflected  # (tokens/s: every token)
    for (prompt, request), traj in zip(engine.asks, [t for t in trajectories if t.attempt.reflection]):
        assert request == f"{traj.messages[-1]['content']}\n\n{REFLECT_ASK}"
        assert prompt == traj.token_ids + fmt.observation(request)


def test_reflect_with_the_tiny_agent_is_token_exact_per_attempt(fmt):
    """Sampled attempts of the embedded agent on BabyAI under a 2-turn cap (most fail): each attempt's tokens
    are its own opening (with its reflections) and its sampled turns, its mask exactly the sampled tokens."""
    engine = HFEngine(load_model("tiny-agent"), fmt, temperature=1.0, seed=0)
    seen = []
    submit = engine.submit

    def record(traj, limit):
        seen.append(traj)
        submit(traj, limit)

    engine.submit = record
    environments = [envs.make("babyai") for _ in range(4)]
    trajectories = rollout(engine, fmt, environments, [1, 2, 3, 4], [0, 1, 2, 3], horizon=2, max_new_tokens=24,
                           max_tokens=4096, agent=make_agent("reflect", 2))
    retried = [t for t in trajectories if t.attempt.number == 2]
    assert retried, "no attempt failed: the test needs a harder cap"
    for traj in trajectories:
        text = fmt.tokenizer.decode(traj.token_ids)
        if traj.finish in ("done", "horizon", "max_tokens"):
            text += fmt.observation_prefix + traj.messages[-1]["content"] + fmt.observation_suffix
        assert text == fmt.render(traj.messages, add_generation_prompt=True)
        assert sum(traj.loss_mask) >= traj.turns
    for traj in retried:
        assert REFLECTIONS in traj.messages[0]["content"]
    assert sum(REFLECT_ASK in t.messages[-1]["content"] for t in seen) == len(retried)


def test_the_viewer_lists_an_attempt_and_shows_its_reflection(fmt):
    """A reflect record's attempt and reflection come before its messages, where the viewer's index reads them."""
    spec = importlib.util.spec_from_file_location("view", Path(__file__).resolve().parent.parent / "scripts" / "view.py")
    view = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(view)
    trajectories = rollout(Scripted(fmt), fmt, [WinOrLose()], [7], [0], horizon=4, max_new_tokens=32, max_tokens=4096,
                           agent=make_agent("reflect", 2))
    rows = [view.summary(json.dumps(t.log_record()).encode()) for t in trajectories]
    assert [(r["attempt"], r["reflection"]) for r in rows] == [(1, "I lost 2 times"), (2, None)]
    assert "reflection, for the next attempt" in (Path(view.__file__).with_name("view.html")).read_text()
