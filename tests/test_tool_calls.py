"""Native tool calling (--agent tools; rl/chat.py, rl/agent.py, envs/tools.py): calls are read in the chat template's
own format (Hermes' <tool_call> blocks, Llama 3.1's JSON), every malformed call is an observation that says what was
wrong and counts as an invalid action without touching the env, the experts play every env through tool calls
exactly as through text, and those episodes are token-exact; a template that renders no tool schemas (SmolLM2's)
or no calls is refused."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

import envs
from envs import tools as env_tools
from rl.agent import REACT, TOOLS_GUIDE, make_agent
from rl.agent import LayoutArgs, chat_format
from rl.chat import CallError, ChatFormat, parse_calls, read_call
from rl.engines import Sample
from rl.engines.expert import ExpertEngine
from rl.model import load_tokenizer
from rollout import rollout
from test_token_exactness import Spy, check_exact

TOOLS = make_agent("tools")


@pytest.fixture(scope="module")
def hermes():
    return ChatFormat(load_tokenizer("tiny-agent"))  # the embedded agent's template renders tools as Qwen2.5's does


@pytest.fixture(scope="module")
def llama(real_tokenizer):
    return ChatFormat(real_tokenizer("llama3_1"))  # Llama 3.1's own template and tokenizer


def test_calls_are_read_in_the_templates_own_format(hermes, llama):
    assert hermes.call_style == "hermes" and llama.call_style == "llama"
    call = ("go_to", {"object": "red ball 1"})
    assert hermes.call_text(*call) == '<tool_call>\n{"name": "go_to", "arguments": {"object": "red ball 1"}}\n</tool_call>'
    assert llama.call_text(*call) == '{"name": "go_to", "parameters": {"object": "red ball 1"}}'
    for fmt in (hermes, llama):
        assert fmt.parse_calls(fmt.call_text(*call)) == [call]
    assert parse_calls("hermes", 'I will go.\n<tool_call>\n{"name": "toggle", "arguments": {}}\n</tool_call>') == \
        [("toggle", {})]
    assert parse_calls("hermes", '<tool_call>{"name": "toggle", "arguments": "{}"}') == [("toggle", {})]  # unclosed
    assert parse_calls("hermes", "Thought: no call here") == []
    assert parse_calls("llama", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}') \
        == [("a", {"x": 1}), ("b", {})]
    assert parse_calls("llama", "I would rather talk.") == []
    assert read_call("get", '{"count": 2, "item": "oak log"}') == ("get", {"count": 2, "item": "oak log"})


@pytest.mark.parametrize("style, text, problem", [
    ("hermes", '<tool_call>{"name": "go_to", "arguments": {"object": ' + "[" * 5000, "nested too deeply"),
    ("llama", '{"name": "go_to", "parameters": {"object": ' + "[" * 5000, "nested too deeply"),
    ("hermes", '<tool_call>{"name": "go_to", "arguments": {"object": ' + "9" * 5000 + "}}</tool_call>", "not valid JSON"),
    ("hermes", "<tool_call>{name: go_to}</tool_call>", "not valid JSON"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', 'must be a JSON object with a "name"'),
    ("hermes", '<tool_call>["go_to"]</tool_call>', 'must be a JSON object with a "name"'),
    ("hermes", '<tool_call>{"name": "go_to", "arguments": "{broken"}</tool_call>', "arguments of go_to are not valid JSON"),
    ("hermes", '<tool_call>{"name": "go_to", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ("llama", '{"name": "go_to", "parameters": {"object": }', "not valid JSON"),
])
def test_a_call_that_cannot_be_read_says_why(style, text, problem):
    with pytest.raises(CallError, match=problem):
        parse_calls(style, text)


@pytest.mark.parametrize("reply, problem", [
    ("Thought: I will move.\n\nAction:\nmove forward", "Your reply calls no tool"),
    ("<tool_call>{not json}</tool_call>", "Invalid tool call: your tool call is not valid JSON"),
    ('<tool_call>{"name": "fly", "arguments": {}}</tool_call>', "fly"),
    ('<tool_call>{"name": "go_to", "arguments": {}}</tool_call>', "object"),
    ('<tool_call>{"name": "go_to", "arguments": {"object": 3}}</tool_call>', "object"),
    ('<tool_call>{"name": "turn_left", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "turn_left", "arguments": {}}</tool_call>', "calls 2 tools"),
])
def test_every_malformed_call_is_an_observation_and_no_action(hermes, reply, problem):
    action = TOOLS.read(hermes, "babyai", reply)
    assert action.text is None and problem in action.problem and action.problem.endswith(".")


def test_a_valid_call_is_the_action_the_env_takes_and_reasoning_stays_out(hermes):
    action = TOOLS.read(hermes, "babyai", hermes.call_text("go_to", {"object": "red ball 1"}))
    assert action.problem is None and action.calls == [("go_to", {"object": "red ball 1"})]
    assert action.text == env_tools.action_text("babyai", "go_to", {"object": "red ball 1"})
    native = TOOLS.read(hermes, "babyai", "", [{"id": "c", "name": "turn_left", "arguments": "{}"}])  # a text engine's
    assert native.text == env_tools.action_text("babyai", "turn_left", {})
    thinking = ChatFormat(hermes.tokenizer, reasoning_tags=("<think>", "</think>"))
    decoy = '<think><tool_call>{"name": "turn_left", "arguments": {}}</tool_call></think>'
    assert TOOLS.read(thinking, "babyai", decoy + hermes.call_text("turn_right", {})).calls == [("turn_right", {})]


def test_a_template_without_tool_calls_is_refused_in_one_sentence(real_tokenizer):
    tokenizer = real_tokenizer("llama3")  # Llama 3's template has no tools
    chat_format(tokenizer, LayoutArgs("react"))  # other formats do not need tool calls
    with pytest.raises(SystemExit, match="chat template renders no tool schemas"):
        chat_format(tokenizer, LayoutArgs("tools"))
    chat_format(real_tokenizer("qwen2_5"), LayoutArgs("tools"))  # (a template that renders tools passes)


def test_smollm2_under_agent_tools_is_refused_naming_it_because_its_template_never_reads_tools():
    tokenizer = load_tokenizer("smollm2-135m")  # its real ChatML template, which renders no tools
    chat_format(tokenizer, LayoutArgs("react"))
    with pytest.raises(SystemExit, match=r"^smollm2-135m's chat template renders no tool schemas \(it never reads "
                                         r"`tools`\), so --agent tools .*: use --agent react$"):
        chat_format(tokenizer, LayoutArgs("tools"))
    # read off the template, not the name: the same template listing the tools gets past it (to the call format)
    tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}" + tokenizer.chat_template
    with pytest.raises(SystemExit, match="renders no tool calls in a format this project reads"):
        chat_format(tokenizer, LayoutArgs("tools"))


class Malformed(ExpertEngine):
    """The experts, but turn 0's reply is `bad` (a malformed call)."""

    def __init__(self, fmt, environments, bad):
        super().__init__(fmt, environments)
        self.bad, self.expert_texts = bad, [bad]

    def generate(self, batch, limits):
        out = super().generate(batch, limits)
        for k, traj in enumerate(batch):
            if traj.turns == 0 and out[k].error is None:
                ids = self.fmt.encode(self.bad) + [self.fmt.end_of_turn]
                out[k] = Sample(ids, [0.0] * len(ids))
        return out


def play(fmt, name, agent, engine_of, count=2, horizon=6):
    environments = [envs.make(name) for _ in range(count)]
    stepped = []
    for env in environments:
        original = env.step
        env.step = lambda text, original=original: stepped.append(text) or original(text)
    engine = engine_of(environments)
    if not hasattr(engine, "expert_texts"):
        engine.expert_texts = []
    spy = Spy(engine, fmt)
    original_experts = engine.experts

    class Recording(dict):  # the expert's own text (a call under tools) is new text, tokenized once
        def __setitem__(self, row, expert):
            def act(observation):
                text = expert(observation)
                engine.expert_texts.append(fmt.call_text(*env_tools.call_of(name, text)) if agent.name == "tools" else text)
                return text
            super().__setitem__(row, act)

    engine.experts = Recording(original_experts)
    try:
        task_ids = [21, 34][:count] if name == "babyai" else envs.splits(name)["test"][:count]  # (babyai: 4 and 3 turns)
        trajectories = rollout(spy, fmt, environments, task_ids, list(range(count)),
                               horizon=horizon, max_new_tokens=512, max_tokens=32768, agent=agent)
    finally:
        for env in environments:
            env.close()
    return spy, trajectories, stepped


def test_a_malformed_call_is_answered_without_the_env_and_the_episode_goes_on(hermes):
    bad = '<tool_call>{"name": "fly", "arguments": {}}</tool_call>'
    spy, trajectories, stepped = play(hermes, "babyai", TOOLS, lambda e: Malformed(hermes, e, bad))
    for traj in trajectories:
        assert traj.invalid_actions == 1 and traj.error is None and traj.turns >= 2
        assert traj.messages[4]["role"] == "tool" and "fly" in traj.messages[4]["content"]
    assert len(stepped) == sum(t.turns - 1 for t in trajectories)
    check_exact(hermes, spy, trajectories)


def ported(name):
    if importlib.util.find_spec(f"envs.{name}") is None:
        pytest.skip(f"envs.{name} is not ported yet")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("sciworld", "webarena") else n
                                  for n in envs.ENVS])
def test_the_experts_play_every_env_through_tool_calls_as_through_text(hermes, name):
    """The same rewards, turns, finishes and observations; the tool episode's first prompt lists the env's tools, every
    later observation is a tool result, and its tokens are exactly the sampled calls and the wrapped results."""
    ported(name)
    _, text, _ = play(hermes, name, REACT, lambda e: ExpertEngine(hermes, e))
    spy, called, stepped = play(hermes, name, TOOLS, lambda e: ExpertEngine(hermes, e))

    def acted(trajectories):  # what each step sent and saw, shown on a mismatch (WebArena's turns differed once in CI)
        return [[str(m.get("tool_calls") or m["content"])[-300:] for m in t.messages[3:]] for t in trajectories]

    def ends(trajectories):
        return [(t.reward, t.turns, t.finish, t.success) for t in trajectories]

    assert ends(called) == ends(text), (acted(called), acted(text))

    def seen(trajectories):  # (Chromium numbers a page's elements anew at every load: WebArena's ids are hidden)
        return [[re.sub(r"\[\d+\]", "[#]", m["content"]) if name == "webarena" else m["content"] for m in t.messages[4::2]]
                for t in trajectories]

    assert seen(called) == seen(text)
    assert sum(t.turns for t in called) >= 2 and all(t.invalid_actions == 0 for t in called)
    check_exact(hermes, spy, called)
    for traj in called:
        assert TOOLS_GUIDE in traj.messages[0]["content"] and traj.tools == env_tools.schemas(name)
        prompt = hermes.tokenizer.decode(spy.prompts[traj.row][0])
        assert all(json.dumps(tool) in prompt for tool in traj.tools)
        assert all(m["role"] == "tool" for m in traj.messages[4::2])
        assert all(m.get("tool_calls") for m in traj.messages[3::2])


def test_llama_style_calls_play_token_exact(llama):
    _, text, _ = play(llama, "babyai", REACT, lambda e: ExpertEngine(llama, e))
    spy, called, _ = play(llama, "babyai", TOOLS, lambda e: ExpertEngine(llama, e))
    assert [(t.reward, t.turns, t.finish) for t in called] == [(t.reward, t.turns, t.finish) for t in text]
    check_exact(llama, spy, called)
    assert "<|start_header_id|>ipython<|end_header_id|>" in llama.tokenizer.decode(called[0].token_ids)


def test_an_env_without_tools_is_refused_in_one_sentence(tmp_path, monkeypatch):
    import train
    from test_add_env import COUNTDOWN

    monkeypatch.setitem(envs.ENVS, "countdown", COUNTDOWN)  # (the docs' recipe env, which declares no tools)
    with pytest.raises(SystemExit, match="the countdown env declares no TOOLS, so it cannot be played with --agent tools"):
        train.main(train.parse_args(["--env", "countdown", "--agent", "tools", "--out-dir", str(tmp_path)]))


@pytest.mark.slow
def test_training_and_eval_play_through_tool_calls(tmp_path):
    """train.py --agent tools on the embedded agent (the tiny preset's tool limits), then eval.py on its checkpoint,
    which plays the run's own layout: every episode opens with the tools, every reply is read as calls, and a run's
    malformed replies are counted."""
    import eval as eval_script
    from rl.flags import build
    import train

    args = train.parse_args(["--agent", "tools", "--steps", "1", "--tasks-per-step", "2", "--n", "2", "--horizon", "2",
                             "--out-dir", str(tmp_path), "--run-name", "tools"])
    assert (args.max_new_tokens, args.max_tokens) == (96, 4096)
    run_dir = train.main(args)
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(TOOLS_GUIDE in r["messages"][0]["content"] for r in records)
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= metrics["rollout/malformed_rate"] <= metrics["rollout/invalid_action_rate"] + 1e-9
    results = eval_script.main(build(eval_script.Args, model=str(run_dir / "checkpoints" / "step_1"), limit=2, k=1,
                                                out=str(tmp_path / "eval")))
    assert results["agent"] == "tools" and results["max_new_tokens"] == 96 and 0 <= results["malformed"] <= 1
    episodes = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert all(TOOLS_GUIDE in e["messages"][0]["content"] for e in episodes)


def test_the_viewer_replays_what_the_env_was_sent(hermes):
    """scripts/view.py replays a logged episode on the env: for a tool-call episode (with a malformed first turn, which
    the env never saw) and for a thinking one, what the env was sent, so the pictures follow the whole episode."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("view", Path(__file__).resolve().parents[1] / "scripts" / "view.py")
    view = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(view)
    bad = '<tool_call>{"name": "fly", "arguments": {}}</tool_call>'
    _, called, _ = play(hermes, "babyai", TOOLS, lambda e: Malformed(hermes, e, bad))
    thinking = ChatFormat(hermes.tokenizer, reasoning_tags=("<think>", "</think>"))
    from test_reasoning import Thinking

    _, thought, _ = play(thinking, "babyai", REACT, lambda e: Thinking(thinking, e))
    for traj in called + thought:
        record = json.loads(json.dumps(traj.log_record()))
        assert len(record["env_actions"]) == traj.turns and (record["env_actions"][0] is None) == (traj in called)
        state = view.replay(record, {})
        assert state["diverged"] is None and len(state["states"]) == traj.turns + 1
        assert state["states"][-1]["reward"] == traj.reward
        assert sum(s["valid"] is False for s in state["states"]) == traj.invalid_actions


def test_an_api_models_calls_are_learnt_as_the_template_writes_them(hermes):
    """An API episode's reply holds its call apart from its text (tool_calls, content empty or a thought): SFT data made
    of it (rl/data.py) learns the call as the template writes one; a local reply, whose text holds its call, as written."""
    from rl.chat import openai_calls
    from rl.data import encode, from_log

    env = envs.make("babyai")
    try:
        opening = TOOLS.opening(env, env.reset(21))
    finally:
        env.close()
    go, turn = ("go_to", {"object": "red ball 1"}), ("turn_left", {})
    messages = [*opening, {"role": "assistant", "content": "", "tool_calls": openai_calls([go], 1)},
                {"role": "tool", "tool_call_id": "call_1_0", "content": "You moved."},
                {"role": "assistant", "content": "I turn.", "tool_calls": openai_calls([turn], 2)},
                {"role": "tool", "tool_call_id": "call_2_0", "content": "Done."},
                {"role": "assistant", "content": hermes.call_text(*go), "tool_calls": openai_calls([go], 3)},
                {"role": "tool", "tool_call_id": "call_3_0", "content": "Done."}]
    ids, mask = encode(hermes, from_log({"item_id": "babyai_21", "reward": 1.0, "messages": messages,
                                         "tools": env_tools.schemas("babyai")}))
    trained = hermes.tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == (hermes.call_text(*go) + "<|im_end|>" + "I turn.\n" + hermes.call_text(*turn) + "<|im_end|>"
                       + hermes.call_text(*go) + "<|im_end|>")
    assert ids[:len(hermes.prompt(opening, tools=env_tools.schemas("babyai")))] == hermes.prompt(opening, tools=env_tools.schemas("babyai"))


def test_a_call_that_cannot_be_read_keeps_what_the_model_wrote(hermes):
    """A model behind an API whose call's arguments are not JSON: the turn is an invalid action, and its message keeps
    the call as the server sent it (invalid_tool_calls) in the rollouts record too, never sent back to the server; a
    local model's malformed call stays in its reply's text, the tokens exactly as sampled."""
    from rl.engines.api import APIEngine, APIFormat
    from tests.test_api_eval import fake_api

    sent = {"id": "call_a", "type": "function", "function": {"name": "go_to", "arguments": '{"object": "red ball'}}

    def answer(body, attempt, authorization):  # (turn 1: the call; turn 2: text, which calls no tool)
        message = {"role": "assistant", "content": None, "tool_calls": [sent]} if len(body["messages"]) == 3 else \
            {"role": "assistant", "content": "Thought: I am lost."}
        return 200, {"choices": [{"index": 0, "finish_reason": "stop", "message": message}], "usage": {}}, {}

    environments = [envs.make("babyai")]
    with fake_api(answer) as (url, seen):
        engine = APIEngine(url, "fake-model", retries=0)
        try:
            traj, = rollout(engine, APIFormat(), environments, [21], [0], horizon=2, max_new_tokens=64, max_tokens=4096,
                            agent=TOOLS)
        finally:
            engine.close()
            environments[0].close()
    raw = [{"id": "call_a", "name": "go_to", "arguments": '{"object": "red ball'}]
    assert traj.invalid_actions == 2 and "not valid JSON" in traj.messages[4]["content"]
    assert traj.messages[3]["invalid_tool_calls"] == raw and "tool_calls" not in traj.messages[3]
    assert json.loads(json.dumps(traj.log_record()))["messages"][3]["invalid_tool_calls"] == raw
    assert len(seen) == 2 and not any("invalid_tool_calls" in m for _, body, _ in seen for m in body["messages"])

    bad = '<tool_call>{"name": "go_to", "arguments": {"object": "red ball</tool_call>'
    spy, trajectories, _ = play(hermes, "babyai", TOOLS, lambda e: Malformed(hermes, e, bad))
    for traj in trajectories:
        assert traj.messages[3]["content"] == bad and traj.log_record()["messages"][3]["content"] == bad
        assert "not valid JSON" in traj.messages[4]["content"] and "invalid_tool_calls" not in traj.messages[3]
    check_exact(hermes, spy, trajectories)
