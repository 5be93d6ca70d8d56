"""ScalingInter-RL's horizon schedule: stage boundaries and fixed caps. (Resuming on the right stage is
tested on the training loop in test_algorithms.py.)"""

import pytest

from rl.horizon import describe, horizon_at


def test_stepwise_stage_boundaries():
    caps = (10, 20, 30)
    assert [horizon_at(s, caps, 100) for s in (1, 100, 101, 200, 201, 300, 10_000)] == [10, 10, 20, 20, 30, 30, 30]


def test_fixed_horizon_is_one_cap():
    assert {horizon_at(s, (15,), 100) for s in range(1, 1000)} == {15}


def test_bad_schedules():
    with pytest.raises(ValueError):
        horizon_at(0, (10,), 100)
    with pytest.raises(ValueError):
        horizon_at(1, (), 100)


def test_describe():
    assert describe((15,), 100, 200) == "15 turns"
    assert describe((10, 20, 30), 100, 250) == "horizon 10 (1-100), 20 (101-200), 30 (201-250) turns"
    assert describe((10, 20, 30), 100, 150) == "horizon 10 (1-100), 20 (101-150) turns"


# ----------------------------------------------------------------------------------------------
# --horizon auto: its rule on scripted histories (metrics.jsonl's rows)

from rl.horizon import auto_horizon, caps_of, known_before  # noqa: E402


def rows(*steps):
    """Metrics rows from (cap, success, cut share) per step, steps counted from 1."""
    return [{"charts/step": i, "rollout/horizon": cap, "rollout/success": success, "finish/horizon": cut}
            for i, (cap, success, cut) in enumerate(steps, 1)]


def caps_over(history, caps=(3, 6, 9), patience=2, cut=0.1, gain=0.02):
    """The cap auto_horizon gives each step of `history` from the rows before it, and the reason of the last."""
    return [auto_horizon(caps, history[:i], patience, cut, gain)[0] for i in range(len(history) + 1)]


def test_auto_raises_when_the_cap_stops_cutting_episodes():
    # the cut share of the last 2 steps: step 2 (0.5, 0.2): 0.35; step 3 (0.2, 0.0): 0.10 <= 0.1 -> raise for step 4
    history = rows((3, 0.1, 0.5), (3, 0.2, 0.2), (3, 0.3, 0.0), (6, 0.3, 0.0), (6, 0.3, 0.2))
    assert caps_over(history) == [3, 3, 3, 6, 6, 9]  # after step 5 the 6-cap's window cut 0.1: raise again
    cap, reason = auto_horizon((3, 6, 9), history[:3], 2, 0.1, 0.02)
    assert cap == 6 and reason.startswith("from 3 after step 3: it cut 10% of the episodes of steps 2-3")


def test_auto_raises_when_success_stops_improving_and_never_before_two_windows():
    # every cap cuts most episodes; success over windows of 2: 0.10, 0.20 (better: stay), then 0.21 (not 0.02 better)
    history = rows((3, 0.1, 0.9), (3, 0.1, 0.9), (3, 0.2, 0.9), (3, 0.2, 0.9), (3, 0.2, 0.9), (3, 0.22, 0.9))
    assert caps_over(history) == [3, 3, 3, 3, 3, 3, 6]
    assert "success 0.210 over steps 5-6, 0.200 before" in auto_horizon((3, 6), history, 2, 0.1, 0.02)[1]
    falling = rows((3, 0.3, 0.9), (3, 0.3, 0.9), (3, 0.1, 0.9), (3, 0.1, 0.9))
    assert caps_over(falling) == [3, 3, 3, 3, 6]  # worse counts as not improving


def test_auto_never_lowers_the_cap_nor_climbs_past_the_last():
    history = rows(*[(3, 0.0, 0.0)] * 4 + [(6, 0.0, 0.0)] * 8)
    assert caps_over(history, caps=(3, 6)) == [3, 3] + [6] * 11
    assert auto_horizon((6,), history, 2, 0.1, 0.02) == (6, "the first cap of 6")


def test_auto_skips_steps_played_under_a_lower_cap():
    # --max-staleness: steps begun before a raise still show the old cap; the new cap's window starts with its own steps
    history = rows((3, 0.0, 0.0), (3, 0.0, 0.0), (3, 0.0, 0.0), (3, 0.0, 0.0), (6, 0.0, 0.5), (6, 0.0, 0.0))
    assert auto_horizon((3, 6, 9), history, 2, 0.1, 0.02)[0] == 6  # steps 3-4 do not count for the 6-cap
    assert auto_horizon((3, 6, 9), history + rows(*[(6, 0.0, 0.0)] * 7)[6:7], 2, 0.1, 0.02)[0] == 9


def test_which_steps_decide_a_cap():
    assert [known_before(j, None) for j in (1, 2, 5)] == [0, 1, 4]  # the step before
    assert [known_before(j, 0) for j in (1, 2, 5)] == [0, 1, 4]  # k = 0: set j opens once step j - 1 is over, as above
    assert [known_before(j, 2) for j in (1, 4, 5)] == [-3, 0, 1]
    assert caps_of(("auto", 3, 6)) == caps_of((3, 6)) == (3, 6)
    assert describe(("auto", 3, 6), 100, 10) == "horizon auto 3, 6 turns"


@pytest.mark.slow  # two training runs (3 steps, resumed to 5): about 7 s of CPU
def test_auto_in_the_loop_resumes_on_the_same_cap(tmp_path):
    """A cut share of at most 1 always holds, so the cap climbs after every 2 steps at it: 1, 1, 2, 2, 3. Resumed after
    step 3 (one step at cap 2), the run must go on at cap 2 for one more step: it reads its history back from
    metrics.jsonl (a run that forgot it would start again at 1)."""
    import json

    from rl.limits import checkpoint_limits
    import train

    def run(*flags):
        return train.main(train.parse_args([
            "--engine", "hf", "--tasks-per-step", "2", "--n", "2", "--max-new-tokens", "8", "--horizon", "auto", "1", "2", "3",
            "--horizon-patience", "2", "--horizon-cut", "1", "--save-every", "1", "--out-dir", str(tmp_path),
            "--run-name", "auto", *flags]))

    run_dir = run("--steps", "3")
    run("--steps", "5", "--resume", str(run_dir / "checkpoints" / "step_3"))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/horizon"] for m in metrics] == [1, 1, 2, 2, 3]
    assert metrics[2]["rollout/horizon_reason"].startswith("from 1 after step 2: it cut")
    assert metrics[4]["rollout/horizon_reason"].startswith("from 2 after step 4")
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert all(r["horizon"] == metrics[r["step"] - 1]["rollout/horizon"] for r in records)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["horizon"] == ["auto", 1, 2, 3]
    assert checkpoint_limits(str(run_dir / "checkpoints" / "step_4"), config, "babyai").horizon == (2,)


def test_auto_alone_climbs_the_presets_stages():
    import train

    assert train.parse_args(["--horizon", "auto"]).horizon == ("auto", 3, 6)  # the tiny preset's ScalingInter stages
    assert train.parse_args(["--horizon", "auto", "4", "8"]).horizon == ("auto", 4, 8)
    assert train.parse_args(["--model", "Qwen/Qwen2.5-3B-Instruct", "--horizon", "auto"]).horizon == ("auto", 10, 20, 30)
    for bad in (["3", "auto"], ["auto", "6", "3"]):
        with pytest.raises(SystemExit, match="--horizon"):
            train.check(train.parse_args(["--horizon", *bad]), 1)


def test_auto_alone_resumes_with_the_same_command_line(tmp_path):
    """`--resume auto` is meant to be the same command line after every crash: `--horizon auto` on it is the ladder the
    run wrote out in its config (auto 3 6), not a change of --horizon that stops the resume."""
    import dataclasses
    import json

    import train

    argv = ["--horizon", "auto", "--resume", "auto", "--run-name", "r", "--out-dir", str(tmp_path)]
    args = train.parse_args(argv)  # no checkpoint yet: a new run
    assert args.horizon == ("auto", 3, 6)
    run = tmp_path / "r"
    checkpoint = run / "checkpoints" / "step_2"
    (checkpoint / "state").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**dataclasses.asdict(args), "run_name": "r"}))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2}))
    (checkpoint / "state" / "schedulers.json").write_text("{}")
    resumed = train.parse_args(argv)
    assert resumed.horizon == ("auto", 3, 6) and resumed.run_args.resume == str(checkpoint)
    with pytest.raises(SystemExit, match="--horizon"):  # another ladder is still a change
        train.parse_args(["--horizon", "auto", "4", "8", *argv[2:]])
