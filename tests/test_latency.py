"""--env-delay (envs/latency.py): specs parse or stop with one sentence, a delayed env answers exactly what its env
answers, its draws repeat per (seed, env index), the guard's timeout bounds a delayed call, and the `webarena`
constants are the fit of the measured data file."""

import math
import random
import time

import pytest

import envs
from envs import latency
from envs.guard import EnvTimeout, close_envs, make_envs
from envs.latency import WEBARENA, Delayed, Distribution, Draws, Latency, parse

TASKS = (0, 3, 7)


@pytest.mark.parametrize("spec", [None, "", "0", "none", "None", "off", " 0 ", 0, 0.0])
def test_zero_and_none_are_no_delay(spec):
    assert parse(spec) is None


def test_each_spec_parses_to_its_distribution():
    assert parse("0.2") == parse(0.2) == Latency(Distribution(0.2, 0.0))  # bench.py's old floats: steps only
    assert parse("0.2*0.5").step.quantile(0.9) == pytest.approx(0.1)
    assert parse("webarena") == WEBARENA and WEBARENA.reset is not None
    assert parse("WebArena * 0.001") == WEBARENA.scaled(0.001)
    lognormal = parse("lognormal:0.5, 1.2")
    assert lognormal == Latency(Distribution(0.5, 1.2)) and lognormal.step.quantile(0.5) == pytest.approx(0.5)
    assert parse("lognormal:0.5,1.2*4").step.quantile(0.5) == pytest.approx(2.0)


@pytest.mark.parametrize("spec", ["fast", "-1", "webarena*", "webarena*0", "webarena*-2", "webarena*x", "2*3*4",
                                  "lognormal:0,1", "lognormal:1", "lognormal:a,b", "pareto:1,2", "*2"])
def test_a_bad_spec_is_refused_in_one_sentence(spec):
    with pytest.raises(ValueError) as error:
        parse(spec)
    message = str(error.value)
    assert "\n" not in message and message.count(". ") == 0 and repr(spec) in message and "webarena" in message
    with pytest.raises(SystemExit, match="is not a delay"):
        make_envs("textcraft", 1, delay=spec)


def test_draws_repeat_per_seed_and_env_index():
    spec = parse("webarena")

    def sequence(seed, index):
        draws = Draws(spec, seed, index)
        return [draws.reset()] + [draws.step() for _ in range(50)]

    assert sequence(0, 3) == sequence(0, 3)
    assert sequence(0, 3) != sequence(0, 4) and sequence(0, 3) != sequence(1, 3)
    assert all(s >= WEBARENA.step.floor for s in sequence(0, 3)[1:])
    # make_envs: env i of a process of rank r draws env (r x count + i)'s stream, whoever made it
    one = make_envs("textcraft", 4, delay="webarena", seed=7)
    split = make_envs("textcraft", 2, delay="webarena", seed=7, rank=1)
    try:
        steps = [[env.delay.step() for _ in range(20)] for env in one[2:] + split]
        assert steps[:2] == steps[2:]
        assert [e.delay.rng.random() for e in one[:2]] != [e.delay.rng.random() for e in one[2:]]
    finally:
        close_envs(one + split)


def transcript(env, task_id: int, replies: list[str]) -> list:
    answers = [env.reset(task_id)]
    for text in replies:
        result = env.step(text)
        answers.append((result.observation, result.reward, result.done, result.info))
    return answers


def test_a_delayed_env_answers_what_its_env_answers_and_passes_the_rest_through():
    plain = envs.make("textcraft")
    delayed = Delayed(envs.make("textcraft"), Draws(parse("webarena*0.001"), 0, 0))
    assert (delayed.name, delayed.instruction, delayed.ack) == (plain.name, plain.instruction, plain.ack)
    for task_id in TASKS:
        assert envs.oracle_episode(delayed, task_id).reward == 1.0  # (its oracle reads the wrapped env's state)
        replies, observation, done = [], plain.reset(task_id), False
        act = envs.oracle(plain)
        while not done:
            replies.append(act(observation))
            result = plain.step(replies[-1])
            observation, done = result.observation, result.done
        replies += ["Action: craft nothing", "no action at all"]  # bad ones too
        assert transcript(delayed, task_id, replies) == transcript(plain, task_id, replies)
        [guarded] = make_envs("textcraft", 1, delay="webarena*0.001")
        assert transcript(guarded, task_id, replies) == transcript(plain, task_id, replies)
        close_envs([guarded])


def test_a_delayed_call_takes_its_draw_and_the_guard_bounds_it():
    [env] = make_envs("babyai", 1, timeout=0.5, delay="0.05")
    env.reset(1)  # a fixed delay leaves resets as they are
    started = time.monotonic()
    env.step("Action: turn left")
    assert time.monotonic() - started >= 0.05
    close_envs([env])

    [env] = make_envs("babyai", 1, timeout=0.3, delay="5")  # slower than the env's timeout, as a hung page
    observation = env.reset(1)
    started = time.monotonic()
    with pytest.raises(EnvTimeout, match="no answer in 0.3 s"):
        env.step("Action: turn left")
    assert time.monotonic() - started < 2
    assert env.env is None and env.reset(1) == observation  # that call failed; the next starts on a fresh instance
    close_envs([env])


def test_the_webarena_constants_are_the_fit_of_the_data_file():
    fitted = latency.fit_webarena()
    for constant, refit in ((WEBARENA.step, fitted.step), (WEBARENA.reset, fitted.reset)):
        for field in ("median", "sigma", "floor", "tail_share", "tail_from", "alpha"):
            assert getattr(constant, field) == pytest.approx(getattr(refit, field), rel=1e-3, abs=1e-9), field


def test_quantiles_are_continuous_at_the_tail_and_scale_with_x():
    step = WEBARENA.step
    assert step.quantile(1 - step.tail_share) == pytest.approx(step.tail_from)
    assert step.quantile(1 - step.tail_share - 1e-9) == pytest.approx(step.tail_from, rel=1e-6)
    shares = (0.01, 0.5, 0.9, 0.99, 0.999)
    assert [step.quantile(p) for p in shares] == sorted(step.quantile(p) for p in shares)
    small = parse("webarena*0.001")
    for p in shares:
        assert small.step.quantile(p) == pytest.approx(0.001 * step.quantile(p))
        assert small.reset.quantile(p) == pytest.approx(0.001 * WEBARENA.reset.quantile(p))
    # draws follow the quantile function: the empirical p50 / p90 / p99 of 20,000 draws
    rng = random.Random(0)
    draws = sorted(small.step.draw(rng) for _ in range(20_000))
    for p in (0.5, 0.9, 0.99):
        assert draws[math.ceil(p * len(draws)) - 1] == pytest.approx(small.step.quantile(p), rel=0.05)
