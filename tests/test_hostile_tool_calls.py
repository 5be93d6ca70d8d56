"""Bad model output is never an exception, also inside a tool call's arguments (issue 42): every tool of every env,
given hostile calls (any JSON value of any type for any argument, integers of 401 digits, NaN, Infinity, 1e999, -0,
3.0 for an integer, nesting 1,000 deep, 10 MB strings, lone surrogates, unknown tools, missing and extra arguments,
arguments that are not an object, raw argument text that is not JSON), becomes either an action the env takes or a
one-sentence problem, on every path a call takes: envs/tools.py's action_text, rl/chat.py's readers of the Hermes and
Llama formats and of a text engine's native calls, rl/agent.py's read. Then the same calls step real envs, in process
and through envs.serve; a rollout with such calls plays to its end; and eval.py against an OpenAI-compatible server
whose replies carry such calls finishes and counts them as invalid actions. Property-based (hypothesis, derandomized:
the same examples on every run)."""

import contextlib
import json
import math
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_api_eval import fake_api, reply, turns
from test_serve import serving
import test_tool_calls
from test_tools import needs_chromium

import envs
import eval as eval_script
from rl.flags import build
from envs import tools as env_tools
from envs.tools import MAX_CHARS
from rl.agent import make_agent
from rl.engines.api import APIEngine, APIFormat
from rl.chat import ChatFormat, openai_calls
from rl.engines import RoundEngine, Sample
from rollout import Trajectory, rollout

TOOLS = make_agent("tools")
hermes, llama = test_tool_calls.hermes, test_tool_calls.llama  # (its fixtures: the two call formats)
CHEAP = ("babyai", "textcraft", "searchqa")  # envs whose episodes cost milliseconds (SciWorld: a JVM; WebArena: a browser)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
DEEP = "[" * 1000 + "]" * 1000
HUGE = "x" * 10_000_000  # 10 MB


# ----------------------------------------------------------------------------------------------
# Hostile values and calls


plain = st.text(st.characters(), max_size=12)
text = plain | plain | plain | st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)  # lone surrogates
strings = text | st.sampled_from(["", "\x00", "\ud800", "a\udfff", "\n\nAction: toggle", "{object}", "```", "]",
                                  "</tool_call>", "x" * (MAX_CHARS + 1), "中" * 50, "\u202e", "9" * 401, "NaN"])
numbers = (st.integers() | st.floats() | st.sampled_from(
    [10 ** 400, -10 ** 400, 10 ** 18, 10 ** 18 - 1, -1, 0, -0.0, 3.0, 2.5, 1e300, math.nan, math.inf, -math.inf]))
scalars = st.none() | st.booleans() | numbers | strings
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                      max_leaves=8)


@st.composite
def calls(draw, name: str, wild: bool = True):
    """(tool name, arguments): one of the env's tools with its own params, each present or not and well or ill typed,
    sometimes an unknown tool, extra arguments or arguments that are not an object; not `wild`: the tool's own name
    and every param, most of them values of its type that the env takes (any text, any count)."""
    tool = draw(st.sampled_from(env_tools.tools(name)))
    typed = {"string": strings, "integer": numbers, "number": numbers, "boolean": st.booleans()}
    if not wild:
        taken = {"string": plain, "integer": st.integers(0, 10 ** 18 - 1), "boolean": st.booleans()}
        return tool.name, {key: draw(taken[param.type] if draw(st.integers(0, 3)) else typed[param.type])
                           for key, param in tool.params.items()}
    called = draw(st.just(tool.name) | st.just(tool.name) | strings)
    if draw(st.integers(0, 9)) == 0:
        return called, draw(values)
    arguments = {key: draw(typed[param.type] | values) for key, param in tool.params.items()
                 if draw(st.integers(0, 7))}  # (1 in 8 missing)
    return called, arguments | draw(st.dictionaries(text, values, max_size=1) | st.just({}))


# raw argument text as a server sends it (OpenAI's `arguments` is a JSON string) or a template writes it
RAW = ['{"count": ' + "9" * 401 + "}", '{"count": ' + "9" * 5000 + "}", '{"element": 1e999}', '{"count": NaN}',
       '{"index": Infinity}', '{"element": -Infinity}', DEEP, '{"object": ' + DEEP + "}", '{"a": ' * 1000 + "1" + "}" * 1000,
       '{"object": "\\ud800"}', '{"text": "\\udfff\\ud800"}', '"\\ud800"', "[1, 2]", "null", "true", '"{}"', "",
       "{", '{"object": "red ball 1"', "{'object': 'red ball 1'}", '{"text": "' + "x" * (MAX_CHARS + 1) + '"}']
# (10 MB: in the tests below, once each)


def raw_arguments(arguments) -> st.SearchStrategy[str]:
    """The arguments as JSON text (Python's json writes NaN and Infinity, and escapes lone surrogates), a prefix of
    it, random text, or one of RAW."""
    written = json.dumps(arguments)
    return st.sampled_from([written, written[:len(written) // 2]]) | text | st.sampled_from(RAW)


def check(action, fmt) -> None:
    """An action the env takes, or a one-sentence problem; either one the rollout can go on with (the calls written
    into the conversation, the problem tokenized as the tool's answer)."""
    assert (action.text is None) != (action.problem is None), action
    if action.problem is not None:
        problem = action.problem
        assert problem.startswith(("Invalid tool call: ", "Your reply calls")) and problem.endswith(".")
        assert "\n" not in problem and len(problem) < 600, problem[:600]
        problem.encode("utf-8")  # (no lone surrogate)
        if isinstance(fmt, ChatFormat):
            fmt.observation(problem, "tool")
    else:
        action.text.encode("utf-8")
        assert len(action.text) < 3 * MAX_CHARS + 100
    written = openai_calls(action.calls, 0)
    json.dumps(written)
    if isinstance(fmt, ChatFormat) and fmt.call_style == "hermes":  # --reasoning drop renders the calls again
        fmt.render([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": written}])


def hermes_reply(called, arguments: str) -> str:
    return f'<tool_call>{{"name": {json.dumps(called)}, "arguments": {arguments}}}</tool_call>'


def llama_reply(called, arguments: str) -> str:
    return f'{{"name": {json.dumps(called)}, "parameters": {arguments}}}'


# ----------------------------------------------------------------------------------------------
# Every tool of every env: an action or a problem, on every path a call takes


@pytest.mark.parametrize("name", list(envs.ENVS))
@SETTINGS
@given(data=st.data())
def test_any_call_to_any_tool_is_an_action_or_a_problem(name, hermes, llama, data):
    called, arguments = data.draw(calls(name))
    try:
        text = env_tools.action_text(name, called, arguments)
        text.encode("utf-8")
    except env_tools.ToolCallError as error:
        assert "\n" not in str(error) and len(str(error)) < 600
    raw = data.draw(raw_arguments(arguments))
    check(TOOLS.read(APIFormat(), name, "", [{"id": "call_0", "name": called, "arguments": raw}]), APIFormat())
    check(TOOLS.read(APIFormat(), name, hermes_reply(called, json.dumps(raw))), APIFormat())  # calls left in the content
    for fmt, write in ((hermes, hermes_reply), (llama, llama_reply)):
        check(TOOLS.read(fmt, name, write(called, json.dumps(arguments))), fmt)
        check(TOOLS.read(fmt, name, write(called, raw)), fmt)  # the arguments' text where the object goes
        check(TOOLS.read(fmt, name, write(called, json.dumps(raw))), fmt)  # as a JSON string, as OpenAI's API writes them


@pytest.mark.parametrize("arguments, problem", [
    ('{"count": ' + "9" * 401 + ', "item": "stick"}',
     "the argument 'count' of get must be an integer of 0 or more with at most 18 digits, not an integer of 401 digits"),
    ('{"count": 1e300, "item": "stick"}',
     "the argument 'count' of get must be an integer of 0 or more with at most 18 digits, not a number of 301 digits"),
    ('{"count": -3, "item": "stick"}',  # (the env would read "get -3 stick" as "get 3 stick")
     "the argument 'count' of get must be an integer of 0 or more with at most 18 digits, not the number -3"),
    ('{"count": 1e999, "item": "stick"}', "the arguments of get are not valid JSON ('1e999' is beyond the range of a number)"),
    ('{"count": NaN, "item": "stick"}', "the arguments of get are not valid JSON (NaN is not a JSON number)"),
    ('{"count": -Infinity, "item": "stick"}', "the arguments of get are not valid JSON (-Infinity is not a JSON number)"),
    ('{"count": 1, "item": ' + DEEP + "}", "the arguments of get are not valid JSON (nested too deeply)"),
    ('{"count": 1, "item": ' + "[" * 100 + "]" * 100 + "}", "the arguments of get are not valid JSON (nested too deeply)"),
    (json.dumps({"count": 1, "item": HUGE}),
     "the argument 'item' of get is 10,000,000 characters long, and an argument holds at most 32,768"),
    ('{"count": 1, "item": "oak \\ud800"}',
     "the argument 'item' of get is not Unicode text: it holds a lone surrogate at character 4"),
    (json.dumps({"count": 1, "item": "stick", HUGE: 1}),
     "get has no argument 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (10,000,000 characters); its arguments are "
     "count, item"),
    ('{"count": 1, "item": "stick", "\\ud800": 1}', "get has no argument '\\ud800'; its arguments are count, item"),
    ("[1]", "the arguments of get must be a JSON object"),
])
def test_each_hostile_argument_is_one_sentence_saying_what_was_wrong(arguments, problem):
    action = TOOLS.read(APIFormat(), "textcraft", "", [{"id": "call_0", "name": "get", "arguments": arguments}])
    assert action.text is None and action.problem == f"Invalid tool call: {problem}. No action was taken."


@pytest.mark.parametrize("arguments, text", [
    ('{"count": 3.0, "item": "stick"}', "Action: get 3 stick"),  # an integer-valued float is an integer
    ('{"count": -0, "item": "stick"}', "Action: get 0 stick"),
    ('{"count": -0.0, "item": "stick"}', "Action: get 0 stick"),
    ('{"count": 999999999999999999, "item": "stick"}', "Action: get 999999999999999999 stick"),  # 18 digits
    ('{"count": 1, "item": "\\ud83d\\ude00"}', "Action: get 1 \U0001F600"),  # a surrogate pair is one character
])
def test_integers_and_text_in_bounds_are_actions(arguments, text):
    assert TOOLS.read(APIFormat(), "textcraft", "", [{"id": "c", "name": "get", "arguments": arguments}]).text == text


@pytest.mark.parametrize("called, arguments, problem", [
    ("get", {"count": 10 ** 5000, "item": "stick"},  # (json refuses to read so many digits; Python refuses to write them)
     "the argument 'count' of get must be an integer of 0 or more with at most 18 digits, not an integer of 5,001 digits"),
    ("get", {"count": math.inf, "item": "stick"}, "the argument 'count' of get must be an integer, not Infinity"),
    ("get", {"count": 1, "item": "stick", 3: 1}, "get has no argument the number 3; its arguments are count, item"),
    (["get"], {}, "there is no tool an array; the tools are get, craft, inventory"),
])
def test_action_text_takes_any_python_value(called, arguments, problem):
    with pytest.raises(env_tools.ToolCallError) as error:
        env_tools.action_text("textcraft", called, arguments)
    assert str(error.value) == problem


def test_a_hostile_tool_name_is_quoted_short_and_escaped(hermes):
    for called in (HUGE, "\ud800", "go to"):
        for raw in ("{", "{}"):
            action = TOOLS.read(APIFormat(), "babyai", "", [{"id": "c", "name": called, "arguments": raw}])
            check(action, APIFormat())
            assert repr(called[:40]) in action.problem
    action = TOOLS.read(hermes, "babyai", hermes_reply("\ud800", "{}"))
    assert action.problem == ("Invalid tool call: there is no tool '\\ud800'; the tools are turn_left, turn_right, "
                              "move_forward, go_to, pick_up, drop, go_through, toggle_and_go_through, toggle, "
                              "check_available_actions. No action was taken.")
    check(action, hermes)


# ----------------------------------------------------------------------------------------------
# Hostile calls step real envs: in process and through envs.serve, step for step the same


@pytest.fixture(scope="module", params=CHEAP)
def env_pair(request):
    """(name, the env in process, the same env through envs.serve), reset to one task."""
    name = request.param
    with serving(name) as url:
        local, remote = envs.make(name), envs.make(name, url=url)
        task = envs.splits(name)["test"][0]
        assert local.reset(task) == remote.reset(task)
        yield name, local, remote, task
        local.close()
        remote.close()


@SETTINGS
@given(data=st.data())
def test_hostile_calls_step_envs_in_process_and_through_the_server_alike(env_pair, data):
    name, local, remote, task = env_pair
    called, arguments = data.draw(calls(name, wild=False) | calls(name))
    action = TOOLS.read(APIFormat(), name, "", [{"id": "c", "name": called, "arguments": json.dumps(arguments)}])
    check(action, APIFormat())
    event("an action" if action.text is not None else "a problem")  # (shown by --hypothesis-show-statistics)
    if action.text is not None:
        here, there = local.step(action.text), remote.step(action.text)
        assert isinstance(here.observation, str)
        assert (here.observation, here.reward, here.done) == (there.observation, there.reward, there.done)
        if here.done:
            assert local.reset(task) == remote.reset(task)


# ----------------------------------------------------------------------------------------------
# A rollout whose replies carry hostile calls plays to its end, in process and through envs.serve


# (tool, arguments) of each env, well formed, that the env takes: the rollout's last turn
TAKEN = {"babyai": ("turn_left", "{}"), "textcraft": ("inventory", "{}"), "searchqa": ("search", '{"query": "Lima"}'),
         "sciworld": ("look_around", "{}"), "webarena": ("scroll", '{"direction": "down"}')}
HOSTILE_REPLIES = [hermes_reply("get", '{"count": ' + "9" * 401 + ', "item": "stick"}'),
                   hermes_reply("go_to", '{"object": ' + DEEP + "}"),
                   hermes_reply("search", '{"query": NaN}'),
                   hermes_reply("answer", '{"answer": 1e999}'),
                   hermes_reply("go_to", '{"object": "\\ud800"}'),
                   hermes_reply("\ud800", "{}"),
                   hermes_reply("\ud800", json.dumps("{"))]  # (a string too long for a turn: the API test below)


class Scripted(RoundEngine):
    """Turn k of every episode is replies[k], sampled as tokens (with the end-of-turn token)."""

    def __init__(self, fmt, replies):
        super().__init__()
        self.fmt, self.replies = fmt, replies

    def generate(self, batch, limits):
        samples = []
        for traj in batch:
            ids = self.fmt.encode(self.replies[traj.turns]) + [self.fmt.end_of_turn]
            samples.append(Sample(ids, [0.0] * len(ids)))
        return samples


@pytest.mark.parametrize("name, served", [
    *(pytest.param(name, served, id=f"{name}-{'served' if served else 'in-process'}") for name in CHEAP
      for served in (False, True)),
    pytest.param("sciworld", False, marks=pytest.mark.slow, id="sciworld-in-process"),  # (a JVM)
    pytest.param("webarena", False, marks=[pytest.mark.slow, needs_chromium], id="webarena-in-process")])  # (a browser)
def test_a_rollout_with_hostile_calls_plays_to_its_end(hermes, name, served):
    last = hermes_reply(*TAKEN[name])
    replies = HOSTILE_REPLIES + [last]
    engine = Scripted(hermes, replies)
    with serving(name) if served else contextlib.nullcontext() as url:
        environments = [envs.make(name, **({"url": url} if served else {})) for _ in range(2)]
        try:
            trajectories = rollout(engine, hermes, environments, envs.splits(name)["test"][:2], [0, 1],
                                   horizon=len(replies), max_new_tokens=512, max_tokens=32768, agent=TOOLS)
        finally:
            for env in environments:
                env.close()
    for traj in trajectories:
        assert traj.error is None and traj.turns == len(replies), traj.error
        assert traj.invalid_actions == traj.malformed == len(HOSTILE_REPLIES)
        answers = [m["content"] for m in traj.messages[4::2]]  # (a call that cannot be read is answered as a user turn)
        assert len(answers) == len(replies) and all(a.startswith("Invalid tool call: ") for a in answers[:-1])
        assert not answers[-1].startswith("Invalid tool call") and traj.actions[-1] == env_tools.action_text(
            name, TAKEN[name][0], json.loads(TAKEN[name][1]))


# ----------------------------------------------------------------------------------------------
# eval.py against an OpenAI-compatible server whose replies carry hostile calls


def test_an_api_eval_whose_replies_carry_hostile_calls_finishes_and_counts_them_invalid(tmp_path):
    """The server's turn k calls get with ARGUMENTS[k] (OpenAI's format: the arguments a JSON string): a count of 401
    digits, nesting 1,000 deep, NaN and a 10 MB string. Each is an invalid action with its one-sentence answer; the
    eval finishes with every episode played to its horizon, none an error."""
    arguments = ['{"count": ' + "9" * 401 + ', "item": "stick"}', '{"count": 1, "item": ' + DEEP + "}",
                 '{"count": NaN, "item": "stick"}', json.dumps({"count": 1, "item": HUGE})]

    def answer(body, attempt, authorization):
        turn = sum(message["role"] == "assistant" for message in body["messages"]) - 1  # (the ack is one)
        status, payload, headers = reply(text="")
        payload["choices"][0]["message"]["tool_calls"] = [
            {"id": f"call_{turn}", "type": "function", "function": {"name": "get", "arguments": arguments[turn]}}]
        return status, payload, headers

    with fake_api(answer) as (url, seen):
        results = eval_script.main(build(eval_script.Args, 
            model="openai:fake-model", base_url=url, env="textcraft", agent="tools", protocol="tiny", limit=2,
            horizon=len(arguments), api_backoff=0.01, out=str(tmp_path / "eval")))
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 2 and results["avg@k"] == 0
    for record in records:
        assert record["error"] is None and record["turns"] == len(arguments) and record["finish"] == "horizon"
        assert record["invalid_actions"] == len(arguments)
        answers = [m["content"] for m in record["messages"][4::2]]
        assert answers == [f"Invalid tool call: {problem}. No action was taken." for problem in (
            "the argument 'count' of get must be an integer of 0 or more with at most 18 digits, not an integer of "
            "401 digits", "the arguments of get are not valid JSON (nested too deeply)",
            "the arguments of get are not valid JSON (NaN is not a JSON number)",
            "the argument 'item' of get is 10,000,000 characters long, and an argument holds at most 32,768")]


def test_a_reply_nested_too_deeply_to_read_fails_its_turn_not_the_eval():
    """A server that sends a call's arguments as a JSON object (the protocol has a string) nested deeper than the
    interpreter's recursion limit (which a dependency may raise: importing openenv sets it to 3,000, so the depth is
    the limit's, not a constant): the reply cannot be read (RecursionError in json.loads), so the turn fails as any
    unreadable reply does, after its retries."""
    deep = "[" * (sys.getrecursionlimit() + 1000) + "]" * (sys.getrecursionlimit() + 1000)

    def answer(body, attempt, authorization):
        status, payload, headers = reply(text="")
        payload["choices"][0]["message"]["tool_calls"] = [
            {"id": "call_0", "type": "function", "function": {"name": "get", "arguments": "DEEP"}}]
        return status, json.dumps(payload).replace('"DEEP"', deep).encode(), headers

    traj = Trajectory("textcraft", 0, 0, 0, [{"role": "user", "content": "Craft a stick."}])
    with fake_api(answer) as (url, seen):
        engine = APIEngine(url, "fake-model", retries=1, backoff=0.01)
        try:
            [sample] = turns(engine, [traj])
        finally:
            engine.close()
    assert len(seen) == 2 and sample.error.startswith("api: RecursionError: maximum recursion depth exceeded")
