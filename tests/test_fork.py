"""Episodes that fork (train.py --group-start fork): Env.fork gives an independent copy of BabyAI, TextCraft and
SearchQA (its own state and random generator, the same state key), SciWorld, WebArena and an env server say why they
cannot (without a JVM or a browser); a forked group's n trajectories hold the prefix's exact tokens, masks and
log-probs and go apart after it, the same under a seed; and GiGPO trains on forked groups from the command line."""

import json

import pytest

import envs
import train
from envs.guard import EnvArgs, make_envs
from rl import flags
from rl.model import load_model, load_tokenizer
from rl.trajectory import spans
from rl.limits import Limits
from rl.metrics import anchor_metrics
from rollout import ChatFormat, HFEngine, Rollouts, Tasks, rollout

# an env, a task, and turns that change its state (each env's own actions)
PLAYS = {"babyai": (3, ["Action: turn left", "Action: move forward"], ["Action: turn right", "Action: turn right"]),
         "textcraft": (5, ["Action: get 1 oak log"], ["Action: get 2 oak log", "Action: inventory"]),
         "searchqa": (None, ["<search>Paris</search>"], ["<search>river</search>", "<search>king</search>"])}


@pytest.mark.parametrize("name", list(PLAYS))
def test_a_fork_is_an_independent_copy(name):
    task, before, after = PLAYS[name]
    env = envs.make(name)
    env.reset(task if task is not None else envs.splits(name)["train"][0])
    for text in before:
        env.step(text)
    twin = env.fork()
    assert twin is not env and twin.state_key() == env.state_key()
    if name == "babyai":  # its own random generator, in the original's state
        assert twin.game is not env.game and twin.game.np_random is not env.game.np_random
        assert twin.game.np_random.bit_generator.state == env.game.np_random.bit_generator.state
    key = env.state_key()
    moved = [twin.step(text) for text in after]
    assert twin.state_key() != key and env.state_key() == key  # the copy's steps never reach the original
    again = [env.step(text) for text in after]  # and the original, played the same, answers as its copy did
    assert [(r.observation, r.reward, r.done) for r in again] == [(r.observation, r.reward, r.done) for r in moved]
    assert env.state_key() == twin.state_key()
    moved_key = twin.state_key()
    env.reset(task if task is not None else envs.splits(name)["train"][0])  # a reset of one leaves the other
    assert twin.state_key() == moved_key
    twin.close()
    env.step(after[0])  # closing a copy leaves the original playing


def test_a_guarded_env_forks_behind_a_guard_of_its_own():
    env = make_envs("textcraft", 1)[0]
    env.reset(5)
    env.step("Action: get 1 oak log")
    twin = env.fork()
    assert twin is not env and twin.env is not env.env and twin.state_key() == env.state_key()
    twin.step("Action: get 3 oak log")
    assert twin.state_key() != env.state_key()
    twin.close()
    env.close()


def test_envs_that_cannot_copy_their_state_say_why(monkeypatch):
    from envs.remote import RemoteEnv
    from envs.webarena import WebArena

    remote = object.__new__(RemoteEnv)  # (no server: its refusal asks it nothing)
    remote.name, remote.url = "babyai", "http://127.0.0.1:36001"
    for env, why in [(envs.make("sciworld"), "its simulator runs in a JVM"),  # (make starts no JVM: a reset does)
                     (object.__new__(WebArena), "the page lives in a browser"),  # (no browser started)
                     (remote, "AgentGym's protocol has no call that copies an instance")]:
        with pytest.raises(NotImplementedError, match=why):
            env.fork()
    env_args, made = EnvArgs(), []  # (the instances the check makes, as the run would make them)
    monkeypatch.setattr(env_args, "make_envs", lambda name, count: (guarded := make_envs(name, count),
                                                                    made.extend(g.env for g in guarded))[0])
    with pytest.raises(SystemExit, match="--group-start fork plays .* a sciworld env cannot copy its state: its "
                                         "simulator runs in a JVM.*: train sciworld with --group-start reset"):
        flags.check_forks(("babyai", "sciworld"), env_args)
    assert [env.name for env in made] == ["babyai", "sciworld"] and made[1].jvm is None  # (asked, it started nothing)


def test_the_flags_that_cannot_fork_are_refused():
    for argv, why in [(["--fork-turns", "0"], "--fork-turns 0: a group branches after 1 turn or more"),
                      (["--agent", "reflect"], "--agent reflect plays each attempt as a rollout of its own")]:
        with pytest.raises(SystemExit, match=why):
            train.check(train.parse_args(["--group-start", "fork", *argv]), 1)


# ----------------------------------------------------------------------------------------------
# A forked group's trajectories


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer("tiny-agent")
    return ChatFormat(tokenizer), load_model("tiny-agent")


def play(tiny, fork, groups=((3, 4), (7, 4)), horizon=4, seed=3, max_tokens=2048, **options):
    fmt, model = tiny
    task_ids = [task for task, n in groups for _ in range(n)]
    group_ids = [g for g, (_, n) in enumerate(groups) for _ in range(n)]
    environments = [envs.make("babyai") for _ in task_ids]
    return rollout(HFEngine(model, fmt, temperature=1.0, seed=seed), fmt, environments, task_ids, group_ids,
                   horizon=horizon, max_new_tokens=24, max_tokens=max_tokens, fork=fork, **options)


def prefix_end(traj, turns):
    """Where the turn after the shared ones begins: its first sampled token (the end, when there is none)."""
    runs = spans(traj.loss_mask)
    return runs[turns][0] if len(runs) > turns else len(traj.token_ids)


@pytest.mark.parametrize("fork", [1, 2])
def test_a_forked_group_shares_the_prefixs_exact_tokens_and_goes_apart_after(tiny, fork):
    trajectories = play(tiny, fork)
    apart = 0
    for group in (0, 1):
        members = [t for t in trajectories if t.group == group]
        assert all(t.prefix_turns == fork for t in members) and len({t.row for t in members}) == 4
        cut = prefix_end(members[0], fork)
        assert spans(members[0].loss_mask)[:fork] and all(prefix_end(t, fork) == cut for t in members)
        for t in members:  # the prefix: the same tokens, loss mask and sampler log-probs, the same messages and states
            assert t.token_ids[:cut] == members[0].token_ids[:cut] and t.loss_mask[:cut] == members[0].loss_mask[:cut]
            assert t.logprobs[:cut] == members[0].logprobs[:cut] and sum(t.loss_mask[:cut]) > 0
            assert t.messages[:3 + 2 * fork] == members[0].messages[:3 + 2 * fork]
            assert t.states[:fork + 1] == members[0].states[:fork + 1]  # the branching state: one anchor for n turns
            assert t.actions[:fork] == members[0].actions[:fork] and t.turns > fork
        # after it each samples its own: the first turn after the prefix differs somewhere in the group
        apart += len({tuple(t.token_ids[cut:prefix_end(t, fork + 1)]) for t in members}) > 1
    assert apart >= 1
    again = play(tiny, fork)  # the same seed, the same groups
    assert [(t.token_ids, t.logprobs, t.loss_mask, t.states) for t in again] == \
        [(t.token_ids, t.logprobs, t.loss_mask, t.states) for t in trajectories]


def test_a_group_whose_first_episode_ends_without_an_env_answer_still_branches(tiny):
    """A first prompt that leaves no room for a reply ends the group's first episode before any env answers it (as a
    failed sample does): its copies are the group's other episodes. (Before, they waited for an answer that never
    came, and the rollout spun for ever.)"""
    import threading

    played = []  # (a daemon thread: a rollout that spins for ever fails the test, not the suite's exit)
    thread = threading.Thread(target=lambda: played.extend(play(tiny, 1, groups=((3, 3),), max_tokens=300)), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the group never began: its copies waited for an env answer"
    assert [t.finish for t in played] == ["max_tokens"] * 3 and len({t.row for t in played}) == 3


def test_a_reset_group_starts_every_episode_by_a_reset(tiny):
    trajectories = play(tiny, None, groups=((3, 3),), horizon=2)
    assert all(t.prefix_turns == 0 for t in trajectories)
    assert len({tuple(t.token_ids[:prefix_end(t, 0)]) for t in trajectories}) == 1  # (the first prompt only)


class DoneAfterOne(envs.Env):
    """An env whose every episode ends after its first turn."""

    name, instruction, ack = "babyai", envs.make("babyai").instruction, envs.make("babyai").ack

    def reset(self, task_id):
        self.turns = 0
        return "You are here."

    def step(self, text):
        self.turns += 1
        return envs.StepResult(f"Done after {text!r}.", 1.0, True, {})

    def state_key(self):
        return str(getattr(self, "turns", None))

    def fork(self):
        raise AssertionError("an episode that ended has nothing to fork")


def test_an_episode_that_ends_within_the_prefix_is_its_groups_every_episode(tiny):
    fmt, model = tiny
    trajectories = rollout(HFEngine(model, fmt, temperature=1.0, seed=0), fmt, [DoneAfterOne() for _ in range(3)],
                           [1, 1, 1], [0, 0, 0], horizon=5, max_new_tokens=16, max_tokens=1024, fork=2)
    assert [(t.finish, t.turns, t.prefix_turns, t.row) for t in trajectories] == [("done", 1, 1, r) for r in range(3)]
    assert len({(tuple(t.token_ids), tuple(t.logprobs)) for t in trajectories}) == 1


def test_a_cap_below_the_prefix_forks_before_the_last_turn(tiny):
    trajectories = play(tiny, 5, groups=((3, 3),), horizon=2)
    assert all(t.prefix_turns == 1 and t.turns == 2 for t in trajectories)


def test_dynamic_sampling_forks_a_replayed_group_again(tiny):
    """A set whose group 0 is played again (rl/tasks.Redraw's place in Rollouts) on a new task: the replay forks too."""
    fmt, model = tiny
    environments = [envs.make("babyai") for _ in range(4)]
    replays = []

    def redraw(j, played):
        replays.append([t.task_id for t in played])
        return {0: 7, 1: 7} if len(replays) == 1 else {}

    rollouts = Rollouts(HFEngine(model, fmt, temperature=1.0, seed=1), fmt, environments,
                        lambda _: Tasks([3, 3, 9, 9], [0, 0, 1, 1], {"babyai": 3}),
                        limits={"babyai": Limits((3,), 1, 24, 2048)}, redraw=redraw, fork=1)
    try:
        trajectories = rollouts.take(1)
    finally:
        rollouts.close()
    assert [t.task_id for t in trajectories] == [7, 7, 9, 9] and len(replays) == 2
    assert all(t.prefix_turns == 1 for t in trajectories)
    assert trajectories[0].token_ids[:prefix_end(trajectories[0], 1)] == \
        trajectories[1].token_ids[:prefix_end(trajectories[1], 1)]
    assert not rollouts.forks.copies and not rollouts.forks.waiting  # (closed with the rollouts)


# ----------------------------------------------------------------------------------------------
# Training on forked groups


def test_a_shared_turn_counts_once_and_its_copies_advantages_sum():
    """rollout/anchored_share and step_advantage_share count the turns the policy sampled: a forked group's shared turn
    once, its copies' step advantages summed (they cancel where it is compared only with its own copies)."""
    def record(reward, states, prefix=1, group=0):
        return {"item_id": "babyai_3", "group": group, "finish": "horizon", "reward": reward, "turns": len(states) - 1,
                "states": states, "prefix_turns": prefix}

    # forked after turn 0 (from state a), at state b: b's turns are 3 samples, 2 of them returning more (the last
    # state, after the last turn, is no turn's)
    forked = [record(1.0, ["a", "b", "c", "e"]), record(1.0, ["a", "b", "c", "f"]), record(0.0, ["a", "b", "d", "g"])]
    metrics = anchor_metrics(forked)
    # sampled turns: a (once), the three from b, and c, c, d after them: 7; a group of >= 2: the three from b, c twice
    assert metrics["rollout/anchored_share"] == pytest.approx(5 / 7)
    # a's copies (returns 0.95, 0.95, 0) sum to 0; b's differ; the two c's tie (both 1): 3 turns of 7
    assert metrics["rollout/step_advantage_share"] == pytest.approx(3 / 7)
    unforked = [dict(r, prefix_turns=0) for r in forked]  # (the same turns, sampled apart: a is 3 turns)
    assert anchor_metrics(unforked)["rollout/step_advantage_share"] == pytest.approx(6 / 9)


RUNS = {
    "gigpo": (1, ["--algo", "gigpo", "--eval-every", "1", "--eval-tasks", "2", "--eval-k", "2"]),
    "grpo-two-envs-tools-window": (1, ["--env", "babyai", "textcraft", "--agent", "tools", "--context", "window:1",
                                       "--dynamic-sampling", "1"]),
    "gigpo-async": (2, ["--algo", "gigpo", "--max-staleness", "1"]),
}


@pytest.mark.slow  # short training runs, about 15 s of CPU each
@pytest.mark.parametrize("run", list(RUNS), ids=list(RUNS))
def test_training_on_forked_groups(tmp_path, run):
    steps, flags_of_run = RUNS[run]
    argv = ["--engine", "hf", "--steps", str(steps), "--tasks-per-step", "2", "--n", "3", "--horizon", "3",
            "--max-new-tokens", "16", "--group-start", "fork", "--fork-turns", "1", "--out-dir", str(tmp_path),
            "--run-name", run, *flags_of_run]
    run_dir = train.main(train.parse_args(argv))
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(records) == 6 * steps and all(r.get("prefix_turns") == 1 or r["turns"] < 1 for r in records)
    for group in {(r["step"], r["item_id"], r["group"]) for r in records}:
        members = [r for r in records if (r["step"], r["item_id"], r["group"]) == group]
        assert len({json.dumps(r["messages"][:5]) for r in members}) == 1  # the first turn and its answer, shared
    assert 0 <= metrics["rollout/step_advantage_share"] <= metrics["rollout/anchored_share"] <= 1
    assert json.loads((run_dir / "config.json").read_text())["group_start"] == "fork"
    if run == "gigpo":  # evaluations start from a reset: nothing of theirs is shared
        evaluated = [json.loads(line) for line in (run_dir / "evaluations.jsonl").read_text().splitlines()]
        assert evaluated and not any("prefix_turns" in r for r in evaluated)
