"""The template audit: every real chat template (rl/artifacts.py, byte-identical to the models' own; SmolLM2's from its
named model) with its real tokenizer, on every env, under --agent react and tools and --reasoning keep and drop (and
Qwen3's enable_thinking on and off): token-in-token-out holds (under keep each turn's prompt is the last one's plus
the sampled tokens plus the observation; under drop it is the template's own rendering of the conversation, as a
client would send it), the loss mask is exactly the sampled tokens (and SFT data made of the episode's log is the
same tokens), the tools render as the template renders them, a reply's call is read in the template's own format and
the env gets exactly its action, reasoning never reaches the env, and a template this project cannot lay out is
refused with one sentence. The "Chat templates" table of docs/reasoning-and-tools.md is STATUS below.

Replies are scripted as a model of that template writes them (its reasoning block, then the env expert's reply or
its call in the template's format) and tokenized as HFEngine returns a sample (the reply's ids, then the end-of-turn
token); the envs are replayed from one recorded expert episode each (tests/data/expert_turns.json, written by
record() below), so no JVM or browser runs. A random-weight model with the real vocabulary samples under the
templates that matter most (slow-marked), and under Llama 3's and Qwen3's in tests/test_token_exactness.py.
"""

import json
import re
from pathlib import Path

import pytest

import envs
from envs import tools as env_tools
from rl.agent import LayoutArgs, chat_format
from rl.chat import ChatFormat
from rl.data import encode, to_record
from rl.engines import RoundEngine, Sample
from rl.engines.hf import HFEngine
from rollout import rollout
from test_token_exactness import Spy, check_exact, random_model

RECORDED = Path(__file__).parent / "data" / "expert_turns.json"

# template -> {(agent, reasoning): status}, the table in docs/reasoning-and-tools.md ("Chat templates"). exact: under
# keep the trajectory's tokens are the template's rendering of the conversation at every turn; own: they are the
# sampled tokens and differ from the rendering, which drops earlier reasoning (drop lays each turn out as the template
# does); refused: the run stops at start with one sentence. Qwen3's hybrid templates (qwen3, qwen3_first_release) are audited with
# enable_thinking on and off ("qwen3:nothink").
EXACT, OWN, REFUSED = "exact", "own tokens", "refused"
STATUS = {
    "qwen2_5": {"react": EXACT, "tools": EXACT},
    "qwen3": {"react": OWN, "tools": EXACT},  # reasoning kept inside a tool-calling chain, dropped before a user turn
    "qwen3:nothink": {"react": OWN, "tools": OWN},  # the generation prompt's empty block is not rendered in history
    "qwen3_first_release": {"react": OWN, "tools": EXACT},
    "qwen3_first_release:nothink": {"react": OWN, "tools": OWN},
    "qwen3_instruct_2507": {"react": EXACT, "tools": EXACT},
    "qwen3_thinking_2507": {"react": OWN, "tools": EXACT},  # opens <think> in the generation prompt
    "llama3": {"react": EXACT, "tools": REFUSED},  # no tools in its template
    "llama3_1": {"react": EXACT, "tools": EXACT},  # tools in the first user turn, results in ipython turns as JSON
    "llama3_2": {"react": EXACT, "tools": EXACT},
    "deepseek_r1_distill": {"react": OWN, "tools": REFUSED},  # opens <think>; calls in its own tokens, not read here
    "gptoss": {"react": REFUSED, "tools": REFUSED},  # harmony
    "smollm2": {"react": EXACT, "tools": REFUSED},  # SmolLM2-135M-Instruct's ChatML: no tools in its template
}
# A call as each format writes it (the model's side, written here apart from rl/chat.py), and a tool's schema as the
# template lists it in the prompt.
NATIVE_CALL = {"hermes": lambda name, arguments: '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
                                                 % (name, json.dumps(arguments)),
               "llama": lambda name, arguments: '{"name": "%s", "parameters": %s}' % (name, json.dumps(arguments))}
SCHEMA_TEXT = {"hermes": json.dumps, "llama": lambda tool: json.dumps(tool, indent=4)}


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORDED.read_text())


def case_format(real_tokenizer, case: str) -> ChatFormat:
    template, _, variant = case.partition(":")
    kwargs = {"enable_thinking": "false"} if variant == "nothink" else {}
    return chat_format(real_tokenizer(template), LayoutArgs(chat_template_kwargs=kwargs))


class Replay(envs.Env):
    """An env that answers with one recorded expert episode, and keeps what it was sent."""

    def __init__(self, name, episode):
        self.name, self.episode, self.sent = name, episode, []
        self.instruction, self.ack = episode["instruction"], episode["ack"]

    def reset(self, task_id):
        return self.episode["first"]

    def step(self, text):
        self.sent.append(text)
        turn = self.episode["turns"][len(self.sent) - 1]
        return envs.StepResult(turn["observation"], turn["reward"], turn["done"], {})


def reasoning_of_turn(k: int, tools: bool) -> str:
    """A turn's reasoning, with a decoy action (and call) that must never reach the env."""
    decoy = '<tool_call>{"name": "decoy", "arguments": {}}</tool_call>' if tools else "Action: decoy"
    return f"Turn {k}: the goal is near. {decoy} would be wrong here."


class Scripted(RoundEngine):
    """Replies as a model of the template writes them: its reasoning block (none where the template has none or
    enable_thinking closed it; only the closing tag where the generation prompt opens it), then the recorded expert's
    reply, or its action as one call in the template's format. A sample is the reply's ids and the end-of-turn token,
    as HFEngine returns one."""

    def __init__(self, fmt, name, episode, tools, thinking):
        super().__init__()
        self.fmt, self.name, self.episode, self.tools, self.thinking = fmt, name, episode, tools, thinking
        self.expert_texts, self.reasonings, self.calls = [], [], []

    def reply(self, k: int) -> str:
        expert = self.episode["turns"][k]["reply"]
        answer = expert
        if self.tools:
            self.calls.append(env_tools.call_of(self.name, expert))
            answer = NATIVE_CALL[self.fmt.call_style](*self.calls[-1])
        block = ""
        if self.thinking and self.fmt.reasoning is not None:
            reasoning = reasoning_of_turn(k, self.tools)
            block = f"{reasoning}\n{self.fmt.reasoning.close}\n\n" if self.fmt.opens_reasoning else \
                f"{self.fmt.reasoning.open}\n{reasoning}\n{self.fmt.reasoning.close}\n\n"
        self.reasonings.append(block)
        return block + answer

    def generate(self, batch, limits):
        out = []
        for traj in batch:
            text = self.reply(traj.turns)
            self.expert_texts.append(text)  # (new text, tokenized once: it stands for the model's sampled tokens)
            ids = self.fmt.encode(text) + [self.fmt.end_of_turn]
            out.append(Sample(ids, [0.0] * len(ids)))
        return out


def client_messages(traj, engine) -> list[dict]:
    """The conversation as an OpenAI-style client sends it to a template: each reply as written (its reasoning in
    its content, as a server without a reasoning parser returns it), a call in tool_calls with its arguments as an
    object, a result as a tool message."""
    messages = [dict(m) for m in traj.messages[:3]]
    for k, observation in enumerate(traj.messages[4::2]):
        if traj.tools:
            name, arguments = engine.calls[k]
            call = {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
            messages += [{"role": "assistant", "content": engine.reasonings[k], "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{k}", "content": observation["content"]}]
        else:
            messages += [{"role": "assistant", "content": traj.messages[3 + 2 * k]["content"]},
                         {"role": "user", "content": observation["content"]}]
    return messages


def rendered(fmt, messages, tools) -> list[int]:
    """The template's own rendering, tokenized by the tokenizer's own apply_chat_template."""
    out = fmt.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **fmt.template_kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


CASES = list(STATUS)


@pytest.mark.parametrize("reasoning", ["keep", "drop"])
@pytest.mark.parametrize("agent", ["react", "tools"])
@pytest.mark.parametrize("name", list(envs.ENVS))
@pytest.mark.parametrize("case", [c for c in CASES if c != "gptoss"])
def test_every_template_lays_out_every_env_token_exact(real_tokenizer, recorded, case, name, agent, reasoning):
    status = STATUS[case][agent]
    if status == REFUSED:
        with pytest.raises(SystemExit, match=r"renders no tool (schemas|calls in a format this project reads).*use --agent react"):
            chat_format(real_tokenizer(case.partition(":")[0]), LayoutArgs(agent, reasoning=reasoning))
        return
    fmt = case_format(real_tokenizer, case)
    episode, tools = recorded[name], agent == "tools"
    env = Replay(name, episode)
    engine = Scripted(fmt, name, episode, tools, thinking=not case.endswith(":nothink"))
    spy = Spy(engine, fmt)
    horizon = len(episode["turns"])
    (traj,) = rollout(spy, fmt, [env], [episode["task_id"]], [0], horizon=horizon, max_new_tokens=2048,
                      max_tokens=65536, agent=LayoutArgs(agent, reasoning=reasoning).make_agent())
    assert traj.error is None and traj.turns == horizon and traj.invalid_actions == 0
    assert traj.reward == episode["turns"][-1]["reward"]

    # the env got exactly the expert's action: reasoning (and the decoy in it) stripped, the call read in the
    # template's format
    module = envs._module(name)
    for k, sent in enumerate(env.sent):
        expert = episode["turns"][k]["reply"]
        assert "decoy" not in sent
        if tools:
            assert sent == env_tools.action_text(name, *engine.calls[k])
        else:
            assert module.read_action(sent) == module.read_action(expert)

    # the loss mask marks exactly the sampled tokens; under drop each turn is a sequence of its own
    prompts, samples = spy.prompts[0], spy.samples[0]
    sequences = traj.sequences if reasoning == "drop" else [(traj.token_ids, traj.loss_mask, None)]
    assert [t for ids, mask, _ in sequences for t, m in zip(ids, mask) if m] == [t for s in samples for t in s]
    for k, prompt in enumerate(prompts):
        ids = sequences[k][0] if reasoning == "drop" else traj.token_ids
        assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(samples[k])] == samples[k]

    # the first prompt is the template's rendering with the tools, listed as the template lists them
    messages = client_messages(traj, engine)
    assert prompts[0] == rendered(fmt, messages[:3], traj.tools)
    if tools:
        text = fmt.tokenizer.decode(prompts[0])
        assert all(SCHEMA_TEXT[fmt.call_style](tool) in text for tool in traj.tools)
        assert traj.tools == env_tools.schemas(name)

    # every later prompt: keep appends (last prompt, sampled tokens, the wrapped observation); drop is the
    # template's own rendering of what a client would send; keep equals that rendering exactly where STATUS says so
    differs = 0
    for k in range(1, len(prompts)):
        template = rendered(fmt, messages[:3 + 2 * k], traj.tools)
        if reasoning == "drop":
            assert prompts[k] == template
            continue
        observation = traj.messages[2 + 2 * k]
        assert prompts[k] == prompts[k - 1] + samples[k - 1] + fmt.observation(observation["content"], observation["role"])
        if prompts[k] != template:
            differs += 1
            # what the template leaves out is earlier reasoning (or an empty block that enable_thinking=false put in
            # the generation prompt), kept here as sampled
            kept, shown = fmt.tokenizer.decode(prompts[k]), fmt.tokenizer.decode(template)
            assert kept.count(fmt.reasoning.close) > shown.count(fmt.reasoning.close)
            assert all(block.strip() in kept for block in engine.reasonings[:k])
    if reasoning == "keep" and len(prompts) > 1:
        assert (EXACT if differs == 0 else OWN) == status
    if reasoning == "keep":  # SFT data made of the episode's log (rl/data.py) is the episode's tokens and mask
        assert encode(fmt, to_record(traj)) == (traj.token_ids, traj.loss_mask)


@pytest.mark.parametrize("case", ["qwen2_5", "llama3", "llama3_1"])
def test_an_observation_is_wrapped_as_the_template_renders_it(real_tokenizer, case):
    """Whitespace around an env's answer: Llama 3's templates trim every message (and Llama 3.1 writes a tool result
    as a JSON string), ChatML keeps it; the scaffolding around an observation is what the template renders."""
    fmt = case_format(real_tokenizer, case)
    opening = [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "OK."},
               {"role": "user", "content": "You see a door."}]
    reply = {"role": "assistant", "content": "Action: open door"}
    eot = fmt.tokenizer.convert_ids_to_tokens(fmt.end_of_turn)

    def upto_reply(messages):  # the conversation's rendering up to the reply's end-of-turn token
        text = fmt.render(messages)
        return text[:text.rindex(eot) + len(eot)]

    for observation in (" \nThe door opens.\n\n", 'A "quoted" \\ answer\n'):
        shown = fmt.render([*opening, reply, {"role": "user", "content": observation}], add_generation_prompt=True)
        assert upto_reply([*opening, reply]) + fmt.wrap(observation) == shown
        if fmt.call_style is not None:
            tool_turn = {**reply, "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "open", "arguments": {"object": "door"}}}]}
            shown = fmt.render([*opening, tool_turn, {"role": "tool", "tool_call_id": "c", "content": observation}],
                               add_generation_prompt=True)
            assert upto_reply([*opening, tool_turn]) + fmt.wrap(observation, "tool") == shown


@pytest.mark.slow  # (~1-3 s each)
@pytest.mark.parametrize("case, agent, reasoning", [
    ("qwen3", "react", "keep"), ("qwen3", "react", "drop"), ("qwen3:nothink", "react", "keep"),
    ("qwen3_thinking_2507", "react", "keep"), ("deepseek_r1_distill", "react", "keep"),
    ("deepseek_r1_distill", "react", "drop"), ("qwen2_5", "tools", "keep"), ("llama3_1", "tools", "keep"),
    ("llama3_1", "tools", "drop")])
def test_a_random_weight_model_samples_token_exact(real_tokenizer, case, agent, reasoning):
    """HFEngine sampling a random-weight model with the real vocabulary (its stop and pad ids, tokens no BPE would
    merge that way, turns cut by the limit): under keep every turn extends the last and the model's text is never
    tokenized again; under drop every prompt is the template's rendering; the loss mask is the sampled tokens."""
    fmt = case_format(real_tokenizer, case)
    spy = Spy(HFEngine(random_model(fmt.tokenizer), fmt, temperature=1.0, seed=1), fmt)
    environments = [envs.make("babyai") for _ in range(2)]
    trajectories = rollout(spy, fmt, environments, [21, 34], [0, 1], horizon=3, max_new_tokens=12, max_tokens=8192,
                           agent=LayoutArgs(agent, reasoning=reasoning).make_agent())
    assert all(t.error is None and t.turns == 3 for t in trajectories)
    if reasoning == "keep":
        check_exact(fmt, spy, trajectories, renders=False)
        return
    for traj in trajectories:
        for k, (ids, mask, _) in enumerate(traj.sequences):
            prompt, sample = spy.prompts[traj.row][k], spy.samples[traj.row][k]
            assert prompt == fmt.prompt(traj.messages[:3 + 2 * k], tools=traj.tools)
            assert ids == prompt + sample + [fmt.end_of_turn] * (sample[-1:] != [fmt.end_of_turn])
            assert [t for t, m in zip(ids, mask) if m] == sample


@pytest.mark.parametrize("case", [c for c in CASES if STATUS[c]["tools"] != REFUSED])
def test_calls_are_written_and_read_in_the_templates_own_format(real_tokenizer, case):
    fmt = case_format(real_tokenizer, case)
    call = ("go_to", {"object": "red ball 1"})
    native = NATIVE_CALL[fmt.call_style](*call)
    assert fmt.call_text(*call).endswith(native)  # (Qwen3 writes a last turn after an empty reasoning block)
    assert fmt.parse_calls(native) == [call] and fmt.parse_calls(fmt.call_text(*call)) == [call]
    assert fmt.parse_calls("Thought: I will not call anything.") == []


@pytest.mark.slow  # (~6 s: the 28 MB gpt-oss tokenizer)
def test_harmony_is_refused_in_one_sentence(real_tokenizer):
    for agent in ("react", "tools"):
        with pytest.raises(SystemExit, match=r"speaks OpenAI's harmony format .* cannot lay out token by token: use another"):
            chat_format(real_tokenizer("gptoss"), LayoutArgs(agent))


def test_the_docs_table_is_the_audit():
    """docs/reasoning-and-tools.md's "Chat templates" table says what STATUS says (a row "as `qwen3`" as qwen3's, in
    either thinking mode)."""
    page = (Path(__file__).parents[1] / "docs" / "reasoning-and-tools.md").read_text()
    section = page[page.index("## Chat templates\n"):]
    rows = {}
    for line in section[:section.index("\n#", 1)].splitlines():
        if line.startswith("| `"):
            cells = line.split(" | ")
            name = re.match(r"\| `(\w+)`", line).group(1) + (":nothink" if "enable_thinking false" in cells[0] else "")
            rows[name] = dict(zip(("react", "tools"), (cell.split(" / ")[0] for cell in cells[2:4])))
    words = {"exact": EXACT, "own tokens": OWN, "refused": REFUSED}
    for case, status in STATUS.items():
        template, _, variant = case.partition(":")
        for agent, expected in status.items():
            said = rows[case if case in rows else template][agent]
            if said.startswith("as `"):
                said = rows[said[4:-1] + (":" + variant if variant else "")][agent].split(" / ")[0]
            assert words[said] == expected, (case, agent, said)


def record():
    """Play each env's expert on one test task for up to 3 turns and write what it replied and observed
    (`PYTHONPATH=.:tests python -c "import test_templates; test_templates.record()"`)."""
    out = {}
    for name in envs.ENVS:
        env = envs.make(name)
        try:
            task_id = 21 if name == "babyai" else envs.splits(name)["test"][0]
            first = observation = env.reset(task_id)
            expert, turns = envs.oracle(env), []
            while len(turns) < 3 and not (turns and turns[-1]["done"]):
                reply = expert(observation)
                result = env.step(reply)
                observation = result.observation
                turns.append({"reply": reply, "observation": observation, "reward": result.reward, "done": result.done})
            out[name] = {"task_id": task_id, "instruction": env.instruction, "ack": env.ack, "first": first,
                         "turns": turns}
        finally:
            env.close()
    RECORDED.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
