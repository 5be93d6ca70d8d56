"""GiGPO (--algo gigpo): the step-level advantages against an independent computation from the paper's definition
on hand-made groups, their place on each turn's action tokens in every layout, groups that never split across
processes, and a run from the command line that logs the anchor groups."""

import json
import statistics
import types

import pytest
import torch

import train
from rl.advantages import AdvantageInputs, advantages, grpo, step_advantages
from rl.batch import make_batch, rows_of
from rl.tasks import Redraw
from rollout import Trajectory


def by_definition(totals, groups, ok, anchors, gamma, scale, eps=1e-6):
    """The paper's eq. 7-8 written out turn by turn: a turn's anchor group is every turn (k', t') of a healthy episode
    of its task group with the same state; R = gamma^(turns after it) x the outcome; alone: no step term."""
    turns = [(k, t) for k in range(len(anchors)) if ok[k] for t in range(len(anchors[k]))]
    returns = {(k, t): gamma ** (len(anchors[k]) - 1 - t) * totals[k] for k, t in turns}
    out = []
    for k, states in enumerate(anchors):
        row = []
        for t, state in enumerate(states):
            peers = [u for u in turns if state is not None and groups[u[0]] == groups[k] and anchors[u[0]][u[1]] == state]
            if not ok[k] or len(peers) < 2:
                row.append(0.0)
                continue
            values = [returns[u] for u in peers]
            centred = returns[k, t] - statistics.fmean(values)
            row.append(centred / (statistics.stdev(values) + eps) if scale else centred)
        out.append(row)
    return out


# Two task groups. Group 0: episodes 0-2 share state "s" at turns 0, 0 and 1 (a shared anchor at different turns), state
# "u" at turns 1 and 2 of episodes 0 and 1; "x" appears once (a singleton); episode 2's third turn has no key (None).
# Episode 3 (group 0) failed in the env: its turns join no group, though it passed through "s". Group 1: equal outcomes at
# the same turns (all-equal returns: 0 over a std of 0), and a state "s" that is group 0's too (another task: no anchor).
TOTALS = [1.0, 0.0, 1.0, 1.0, 0.5, 0.5]
GROUPS = [0, 0, 0, 0, 1, 1]
OK = [True, True, True, False, True, True]
ANCHORS = [["s", "u", "x"], ["s", "u", "v"], ["a", "s", None], ["s", "u"], ["s", "w"], ["s", "w"]]


@pytest.mark.parametrize("scale", [True, False], ids=["mean-std", "mean"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_step_advantages_equal_the_definition(scale, gamma):
    got = step_advantages(TOTALS, GROUPS, OK, ANCHORS, gamma, scale)
    expected = by_definition(TOTALS, GROUPS, OK, ANCHORS, gamma, scale)
    assert [len(row) for row in got] == [len(a) for a in ANCHORS]
    for row, want in zip(got, expected):
        assert row == pytest.approx(want, abs=1e-9)
    assert got[0][2] == got[1][2] == got[2][0] == got[2][2] == 0.0  # singletons, an episode's own state, no key
    assert got[3] == [0.0, 0.0]  # the env failed
    assert got[4] == got[5] == [0.0, 0.0]  # equal returns


def test_turns_whose_returns_tie_get_exactly_zero():
    """Three turns from one state, each returning 0.1: their float64 mean is not 0.1, and that rounding (1e-17) over
    their std (2e-17) gave each a step advantage of 1e-11, which --dynamic-sampling would take for a signal."""
    assert step_advantages([0.1] * 3, [0] * 3, [True] * 3, [["s"]] * 3, 1.0) == [[0.0]] * 3


def test_step_advantages_by_hand():
    # state "s", gamma 0.9: episode 0 at turn 0 of 3 (R = 0.81), episode 1 at turn 0 of 3 (R = 0), episode 2 at turn 1
    # of 3 (R = 0.9): mean 0.57, unbiased std 0.4948; mean mode: R - 0.57
    got = step_advantages(TOTALS, GROUPS, OK, ANCHORS, 0.9, scale=False)
    assert [got[0][0], got[1][0], got[2][1]] == pytest.approx([0.81 - 0.57, -0.57, 0.9 - 0.57])
    std = statistics.stdev([0.81, 0.0, 0.9])
    got = step_advantages(TOTALS, GROUPS, OK, ANCHORS, 0.9, scale=True)
    assert got[1][0] == pytest.approx(-0.57 / (std + 1e-6))


def episode(group: int, reward: float, turns: int, states: list, ok: bool = True, row: int = 0) -> Trajectory:
    """A trajectory of `turns` turns laid out as [prompt, act, act, obs, act, act, obs, ...]: two action tokens a turn."""
    traj = Trajectory("babyai", 0, group, row, [], reward=reward, turns=turns, states=states)
    traj.add([1, 2])
    for t in range(turns):
        traj.add([10 + t, 20 + t], [-0.1, -0.2], trained=True)
        before = len(traj.token_ids) - 2  # (--reasoning drop's row: the conversation so far, this turn alone trained)
        traj.sequences.append((list(traj.token_ids), [0] * before + [1, 1], [0.0] * before + [-0.1, -0.2]))
        traj.add([3])
    if not ok:
        traj.fail("step failed: boom")
    return traj


def inputs(batch, **more) -> AdvantageInputs:
    """A batch's AdvantageInputs as train.advantages_for gives them (no critic; no KL penalty unless `more` gives
    one)."""
    return AdvantageInputs(scores=batch.scores, groups=batch.groups, ok=batch.ok, mask=batch.full.loss_mask,
                           episodes=batch.episodes, anchors=batch.anchors, turn=batch.full.turn, **more)


def played():
    return [episode(g, r, len(a), a + ["end"], ok, row=k)
            for k, (g, r, a, ok) in enumerate(zip(GROUPS, TOTALS, ANCHORS, OK))]


@pytest.mark.parametrize("drop", [False, True], ids=["a row an episode", "a row a turn"])
@pytest.mark.parametrize("omega", [0.0, 0.5])
def test_each_turns_tokens_get_the_episodes_advantage_plus_omega_times_the_turns(drop, omega):
    trajectories = played()
    if not drop:
        for traj in trajectories:
            traj.sequences = []
    rows, episodes = rows_of(trajectories)
    batch = make_batch(rows, 0, [[[i]] for i in range(len(rows))], "cpu", episodes=episodes)
    assert batch.anchors == ANCHORS
    adv, _ = advantages("gigpo", inputs(batch), gamma=0.9, step_weight=omega)
    per_episode = torch.zeros(len(TOTALS))
    per_episode[torch.tensor(OK)] = grpo(torch.tensor(TOTALS)[torch.tensor(OK)], torch.tensor(GROUPS)[torch.tensor(OK)])
    steps = by_definition(TOTALS, GROUPS, OK, ANCHORS, 0.9, True)
    mask, turn = batch.full.loss_mask, batch.full.turn
    for b, k in enumerate(batch.episodes.tolist()):
        for i in range(mask.shape[1]):
            want = float(per_episode[k]) + omega * steps[k][int(turn[b, i])] if mask[b, i] and OK[k] else 0.0
            assert float(adv[b, i]) == pytest.approx(want, abs=1e-5), (b, i)
    assert (turn[(mask == 0) & batch.ok[:, None]] == -1).all()  # (a failed episode's tokens: mask 0, turns kept)
    if omega == 0.0:  # no step term: GRPO's advantages exactly
        plain, _ = advantages("grpo", inputs(batch))
        torch.testing.assert_close(adv, plain)


@pytest.mark.parametrize("drop", [False, True], ids=["a row an episode", "a row a turn"])
def test_dynamic_sampling_keeps_a_gigpo_group_whose_outcomes_tie_but_whose_turns_differ(drop):
    """--dynamic-sampling judges a group by the estimator's own advantages (rl/tasks.Redraw). Two successes, one in 2
    turns and one looping back to "a" in 4, tie in outcome, so GRPO replays their group; under gigpo the turns taken
    from "a" return 0.95 and 0.95^3, and the group is kept. A gigpo group whose episodes took the same path has no
    signal and plays again, as does the first under --step-weight 0 (GRPO's advantages alone)."""
    tied = [episode(0, 1.0, 2, ["a", "b", "end"], row=0), episode(0, 1.0, 4, ["a", "c", "a", "b", "end"], row=1)]
    alike = [episode(1, 1.0, 2, ["a", "b", "end"], row=2), episode(1, 1.0, 2, ["a", "b", "end"], row=3)]
    if not drop:
        for traj in tied + alike:
            traj.sequences = []
    ids = {"babyai": list(range(100, 200))}
    assert sorted(Redraw(ids, rounds=1, seed=1, algo="gigpo")(1, tied + alike)) == [2, 3]
    assert sorted(Redraw(ids, rounds=1, seed=1, algo="grpo")(1, tied + alike)) == [0, 1, 2, 3]
    assert sorted(Redraw(ids, rounds=1, seed=1, algo="gigpo", flags={"step_weight": 0.0})(1, tied + alike)) == \
        [0, 1, 2, 3]


def test_task_groups_never_split_across_processes():
    """my_tasks gives each process whole tasks (their n episodes), so each process computes GiGPO over complete
    anchor groups: the per-process advantages are those of the whole step's batch."""
    tasks, n = list(range(100, 108)), 3
    for world in (1, 2, 4, 8):
        placed = {}
        for rank in range(world):
            mine, groups = train.my_tasks(tasks, n, types.SimpleNamespace(process_index=rank, num_processes=world))
            for task, group in zip(mine, groups):
                placed.setdefault(task, set()).add((rank, group))
        assert sorted(placed) == tasks and all(len(where) == 1 for where in placed.values())
    # the step split over two processes (each with its own group numbering) vs in one piece
    trajectories = played()
    halves = [trajectories[:4], trajectories[4:]]  # group 0 on process 0, group 1 on process 1
    whole = step_advantages(TOTALS, GROUPS, OK, ANCHORS, 0.95, True)
    split = [step_advantages([t.reward for t in half], [t.group for t in half], [t.error is None for t in half],
                             [t.states[:t.turns] for t in half], 0.95, True) for half in halves]
    assert split[0] + split[1] == whole


CROSSINGS = {
    "sync": ["--horizon", "3"],
    # the asynchronous loop (Rollouts: states recorded as turns come in, partial rollouts) with an auto horizon that
    # climbs after every step it knows of (a cut share of at most 1 always holds), from the steps finished when a set
    # begins, and LoRA over two mini-batches
    "async-auto-lora": ["--max-staleness", "1", "--horizon", "auto", "2", "3", "--horizon-patience", "1",
                        "--horizon-cut", "1", "--lora-rank", "4", "--minibatches", "2", "--micro-batch-size", "2"],
}


@pytest.mark.slow  # training runs (2 and 4 steps): about 15 s of CPU each
@pytest.mark.parametrize("crossing", list(CROSSINGS), ids=list(CROSSINGS))
def test_gigpo_trains_from_the_command_line_and_logs_its_anchor_groups(tmp_path, crossing):
    steps = 4 if crossing != "sync" else 2
    args = train.parse_args(["--engine", "hf", "--steps", str(steps), "--tasks-per-step", "2", "--n", "4",
                             "--max-new-tokens", "16", "--algo", "gigpo", "--step-weight", "0.5", "--out-dir", str(tmp_path),
                             "--run-name", "g", *CROSSINGS[crossing]])
    run_dir = train.main(args)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == list(range(1, steps + 1))
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["horizon"] == metrics[r["step"] - 1]["rollout/horizon"] for r in records)
    if crossing != "sync":  # step 4's cap is the first to come from a step (k = 1: steps up to j - k - 2, step 1)
        assert [m["rollout/horizon"] for m in metrics] == [2, 2, 2, 3]
        assert all(torch.isfinite(torch.tensor(m["losses/policy"])) for m in metrics)
    for m, step in zip(metrics, range(1, steps + 1)):
        mine = [r for r in records if r["step"] == step]
        turns = sum(r["turns"] for r in mine if r["finish"] != "error")
        assert all(len(r["states"]) == r["turns"] + 1 for r in mine if r["finish"] != "error")
        assert m["rollout/anchor_groups"] >= 1 and m["rollout/anchor_size"] * m["rollout/anchor_groups"] == turns
        assert 0 <= m["rollout/anchored_share"] <= 1
    assert any(m["rollout/anchored_share"] > 0 for m in metrics)  # 4 episodes of a task start from one state
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == "gigpo" and config["step_weight"] == 0.5


def test_gigpo_needs_groups():
    with pytest.raises(SystemExit, match="--n 2 or more"):
        train.check(train.parse_args(["--algo", "gigpo", "--n", "1"]), 1)


def test_a_turns_return_holds_no_kl_penalty_paid_before_it():
    """--kl-in-reward: a turn's return is the discounted sum of its episode's later rewards, so the KL penalty of an
    earlier turn is not in it. Two episodes with one outcome meet in state "b" at turn 1, one of them having paid a
    penalty in turn 0: from "b" on they earned the same, and the turns from "b" get no step advantage."""
    trajectories = [episode(0, 1.0, 2, ["a", "b", "end"], row=0), episode(0, 1.0, 2, ["c", "b", "end"], row=1)]
    for traj in trajectories:
        traj.sequences = []
    batch = make_batch(trajectories, 0, [[[0]], [[1]]], "cpu")
    mask, turn = batch.full.loss_mask, batch.full.turn
    penalty = torch.zeros_like(mask)
    penalty[0, 2] = 0.5  # episode 0's first turn
    got = {}
    for algo in ("gigpo", "grpo"):
        got[algo], _ = advantages(algo, inputs(batch, penalty=penalty), gamma=1.0)
    step_term = got["gigpo"] - got["grpo"]
    assert (step_term[turn == 1] == 0).all()
    # a penalty paid from "b" on does count: episode 0 paid 0.5 in its second turn, from "b"
    penalty = torch.zeros_like(mask)
    penalty[0, 5] = 0.5
    gigpo, _ = advantages("gigpo", inputs(batch, penalty=penalty), gamma=1.0)
    grpo_only, _ = advantages("grpo", inputs(batch, penalty=penalty))
    assert float((gigpo - grpo_only)[0, 5]) < 0 < float((gigpo - grpo_only)[1, 5])
    assert step_advantages([1.0, 1.0], [0, 0], [True, True], [["a", "b"], ["c", "b"]], 1.0, True,
                           penalties=[[0.5, 0.0], [0.0, 0.0]]) == [[0.0, 0.0], [0.0, 0.0]]


def test_step_weight_is_not_negative():
    with pytest.raises(SystemExit, match="--step-weight"):
        train.check(train.parse_args(["--algo", "gigpo", "--step-weight", "-1"]), 1)


def test_gigpo_without_state_keys_says_it_trains_as_grpo():
    """An env without Env.state_key (a user's, or one behind an upstream server): every turn stands alone, the step
    term is 0, and the run says so rather than quietly being GRPO."""
    trajectories = played()
    for traj in trajectories:
        traj.sequences, traj.states = [], [None] * len(traj.states)
    batch = make_batch(trajectories, 0, [[[i]] for i in range(len(trajectories))], "cpu")
    args = train.parse_args(["--algo", "gigpo"])
    with pytest.warns(UserWarning, match="no state keys"):
        adv, _ = train.advantages_for(args, batch.full, batch.scores, batch.groups, batch.ok, None, batch.episodes,
                                      batch.anchors)
    plain, _ = advantages("grpo", inputs(batch))
    torch.testing.assert_close(adv, plain)
