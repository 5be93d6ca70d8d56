"""The tools a standard declares as our native tools: an OpenEnv MCP environment's (envs/standards/openenv.py: `--env
openenv:tests.guess_mcp.GuessMCPEnvironment --agent tools`) and a verifiers taskset's toolsets (envs/standards/
verifiers.py: `--env verifiers:guess_vftools`, tests/guess_vftools.py). Their schemas are read from the environment
(in process and from its server) or the taskset's tool servers, a call becomes one JSON line that step reads back into
a CallToolAction or an MCP call and whose result is the observation, a task id replays its episode, a react agent is
told the tools and the line, and train.py and eval.py play both through tool calls; a tool whose arguments are not
strings, integers, numbers or booleans is skipped, an env with none left is refused, a tool that fails is answered, and
a tool server that cannot run here is refused, in one sentence each."""

import json

import pytest

pytest.importorskip("openenv", reason="the standards are optional: pip install -r requirements-standards.txt")
pytest.importorskip("verifiers", reason="the standards are optional: pip install -r requirements-standards.txt")

from fastmcp import FastMCP  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402

import envs  # noqa: E402
from envs import tools as env_tools  # noqa: E402
from envs.standards import openenv as adapter  # noqa: E402
import verifiers.v1 as vf  # noqa: E402
from envs.standards import tool_calls  # noqa: E402
from envs.standards.verifiers import END  # noqa: E402
from test_serve import serving_app  # noqa: E402
from test_standards import play  # noqa: E402
from tests.guess_mcp import app  # noqa: E402

MCP = "openenv:tests.guess_mcp.GuessMCPEnvironment"
VF = "verifiers:guess_vftools"  # (tests/ is on sys.path: verifiers imports a taskset by a dotless name)
GUESS = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer", "description": ""}},
                   "required": ["number"]}}}


@pytest.fixture(scope="module")
def mcp_url():
    with serving_app(app()) as url:
        yield url


def test_the_tools_schemas_are_read_from_the_environment_in_process_and_from_its_server(mcp_url):
    assert env_tools.schemas(MCP) == [GUESS]
    assert env_tools.schemas(f"openenv:{mcp_url}") == [GUESS]
    with pytest.raises(ValueError, match="declares no TOOLS"):  # (an OpenEnv env that is not an MCP one)
        env_tools.tools("openenv:tests.guess_openenv.GuessEnvironment")


def test_a_call_round_trips_text_to_call_tool_action_to_observation(mcp_url):
    text = env_tools.action_text(MCP, "guess", {"number": 4.0})  # (an integer-valued float is an integer)
    assert text == 'Action: {"tool": "guess", "arguments": {"number": 4}}'
    assert adapter.call_payload(text) == {"type": "call_tool", "tool_name": "guess", "arguments": {"number": 4}}
    assert env_tools.call_of(MCP, f"Thought: halfway.\n{text}") == ("guess", {"number": 4})
    with pytest.raises(env_tools.ToolCallError, match="must be an integer"):
        env_tools.action_text(MCP, "guess", {"number": "four"})
    local, served = envs.make(MCP), envs.make(f"openenv:{mcp_url}")
    for env in (local, served):
        assert env.reset(3) == "The secret is a number from 1 to 8."  # (seed 3: the secret is 4)
        assert env.step(env_tools.action_text(MCP, "guess", {"number": 2})) == envs.StepResult("Higher.", 0.0, False,
                                                                                               {"valid": True})
        assert env.step("Action: guess 4") == envs.StepResult(tool_calls.CALL_FORMAT, 0.0, False, {"valid": False})
        unknown = env.step('Action: {"tool": "shout", "arguments": {}}')
        assert unknown.observation == "Error: Unknown tool: 'shout'" and not unknown.done
        assert env.step(text) == envs.StepResult("Correct!", 1.0, True, {"valid": True})
        env.close()


def test_a_task_id_replays_the_same_episode_in_process_and_on_the_server(mcp_url):
    local, served = envs.make(MCP), envs.make(f"openenv:{mcp_url}")
    replies = [env_tools.action_text(MCP, "guess", {"number": n}) for n in (4, 6, 7, 8, 2)]
    for task_id in (0, 5, 12):
        episode = play(local, task_id, replies)
        assert play(local, task_id, replies) == episode == play(served, task_id, replies)
        assert episode[-1].done and episode[-1].reward == float(episode[-1].observation == "Correct!")
    local.close(), served.close()


def test_a_react_agent_is_told_the_tools_and_the_call_line_that_step_reads_back(mcp_url):
    from rl.agent import make_agent

    line = env_tools.action_text(MCP, "guess", {"number": 1})  # (the tools agent's call, as the env takes it)
    for env in (envs.make(MCP), envs.make(f"openenv:{mcp_url}")):
        instruction = make_agent("react").instruction(env)
        assert instruction.startswith("Guess the secret number from 1 to 8.\n\nYou act by calling one of these tools")
        assert "\n- guess(number: integer): Guess the secret number.\n" in instruction
        assert instruction.endswith(f"Thought: I think ...\n{line}")  # (the example is the canonical line itself)
        env.reset(3)
        assert env.step(f"Thought: I start low.\n{line}") == envs.StepResult("Higher.", 0.0, False, {"valid": True})
        env.close()
    listed = [{"name": "move", "description": "Move.", "input_schema": {"properties": {
        "to": {"type": "array"}, "speed": {"type": "string", "enum": ["slow", "fast"], "description": "How fast."},
        "far": {"type": "boolean"}}, "required": ["speed", "to"]}}, {"name": "wait", "input_schema": {}}]
    assert tool_calls.guide(listed).splitlines()[1:4] == [  # (every tool, also one --agent tools skips)
        "- move(to: array; speed: string; far: boolean, optional): Move.", "    speed: How fast.", "- wait()"]
    assert tool_calls.guide(listed).endswith('Action: {"tool": "move", "arguments": {"to": [], "speed": "slow"}}')


def test_a_tool_of_other_arguments_is_skipped_and_an_env_with_none_is_refused(capsys, monkeypatch):
    listed = {"name": "move", "description": "Move.", "input_schema": {
        "properties": {"to": {"type": "array", "items": {"type": "integer"}}}, "required": ["to"]}}
    assert tool_calls.tool_of(listed) == ('the tool move is skipped: its argument to is {"type": "array", "items": '
                                       '{"type": "integer"}}, and a tool\'s arguments here are strings, integers, '
                                       'numbers or booleans')
    optional = tool_calls.tool_of({"name": "say", "description": "", "input_schema": {"properties": {
        "text": {"type": "string"}, "loud": {"type": "boolean"}}, "required": ["text"]}})
    for arguments in ({"text": "hé"}, {"text": "hi", "loud": True}):  # (strings without escapes, booleans read back)
        line = optional.action(arguments)
        assert json.loads(line) == {"tool": "say", "arguments": arguments}
        assert optional.pattern().fullmatch(line).groupdict() == {"loud": None, **{k: str(v).lower() if
                                                                  isinstance(v, bool) else v for k, v in arguments.items()}}
    import tests.guess_mcp as module

    class Arrays(module.GuessMCPEnvironment):
        def __init__(self):
            mcp = FastMCP("arrays")

            @mcp.tool
            def move(to: list[int]) -> str:
                """Move."""
                return "moved"

            MCPEnvironment.__init__(self, mcp)
            self.max_turns, self.secret, self.turns, self.won = 4, 0, 0, False

    monkeypatch.setattr(module, "Arrays", Arrays, raising=False)
    with pytest.raises(SystemExit, match=r"^openenv:tests.guess_mcp.Arrays lists no tool whose arguments are all "
                                         r"strings, integers, numbers or booleans, so it cannot be played with "
                                         r"--agent tools$"):
        from rl.agent import check_layout
        check_layout("tools", "openenv:tests.guess_mcp.Arrays")
    assert "openenv:tests.guess_mcp.Arrays: the tool move is skipped: its argument to is" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# The tools agent, the trainer and eval.py on it


def test_the_tools_agent_lays_the_schema_out_and_steps_a_models_call():
    from rl.agent import make_agent
    from rl.chat import ChatFormat
    from rl.model import load_tokenizer

    agent, fmt, env = make_agent("tools"), ChatFormat(load_tokenizer("tiny-agent-tools")), envs.make(MCP)
    assert agent.tools(env) == [GUESS]
    prompt = fmt.tokenizer.decode(fmt.prompt(agent.opening(env, env.reset(3)), tools=agent.tools(env)))
    assert json.dumps(GUESS["function"]["parameters"]) in prompt  # (the template lays the schema out, as Qwen2.5's)
    action = agent.read(fmt, MCP, '<tool_call>\n{"name": "guess", "arguments": {"number": 4}}\n</tool_call>')
    assert action.calls == [("guess", {"number": 4})] and env.step(action.text).observation == "Correct!"
    wrong = agent.read(fmt, MCP, '<tool_call>\n{"name": "guess", "arguments": {"number": -1}}\n</tool_call>')
    assert wrong.text is None and "must be an integer of 0 or more" in wrong.problem
    env.close()


@pytest.mark.slow
@pytest.mark.parametrize("spec", [MCP, VF])
def test_train_and_eval_play_a_standards_tools_through_tool_calls(spec, tmp_path):
    import eval as eval_script
    import train
    from rl.agent import TOOLS_GUIDE
    from rl.flags import build
    from rl.model import EMBEDDED

    args = train.parse_args(["--env", spec, "--agent", "tools", "--model", "tiny-agent-tools", "--steps", "1",
                             "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--eval-every", "0",
                             "--out-dir", str(tmp_path), "--run-name", "tools"])
    run_dir = train.main(args)
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 4 and all(r["error"] is None and r["item_id"].startswith(spec) for r in rollouts)
    assert all(TOOLS_GUIDE in r["messages"][0]["content"] for r in rollouts)
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["charts/step"] == 1
    result = eval_script.main(build(eval_script.Args, model=str(EMBEDDED["tiny-agent-tools"]), env=(spec,),
                                    agent="tools", engine="hf", limit=2, k=1, horizon=(2,), out=str(tmp_path / "eval")))
    assert (result["env"], result["agent"], result["tasks"], result["errors"]) == (spec, "tools", 2, 0)


# ----------------------------------------------------------------------------------------------
# A verifiers taskset's toolsets (tests/guess_vftools.py: row i's secret is i % 8 + 1)

GUESS_VF = {"type": "function", "function": {
    "name": "guess_toolset_guess", "description": "Guess the secret number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer", "description": ""}},
                   "required": ["number"]}}}


def vf_call(tool: str, **arguments) -> str:
    return env_tools.action_text(VF, tool, arguments)


def test_a_tasksets_tools_are_its_servers_and_a_call_runs_on_the_episodes_state():
    schemas = env_tools.schemas(VF)  # (the servers' tools, named as verifiers' harnesses name them, then final_answer)
    assert [one["function"]["name"] for one in schemas] == ["guess_toolset_guess", "guess_toolset_parity",
                                                            "final_answer"]
    assert schemas[0] == GUESS_VF and schemas[2]["function"]["parameters"]["required"] == ["answer"]
    guess = vf_call("guess_toolset_guess", number=4)
    assert guess == 'Action: {"tool": "guess_toolset_guess", "arguments": {"number": 4}}'
    assert env_tools.call_of(VF, f"Thought: halfway.\n{guess}") == ("guess_toolset_guess", {"number": 4})
    env = envs.make(VF)
    assert env.reset(6) == "Which number is it?"  # (row 6: the secret is 7)
    assert env.step(guess) == envs.StepResult("Higher.", 0.0, False, {})
    assert env.step(vf_call("guess_toolset_parity")).observation == "odd"
    # what the episode is not stepped on: no call line, arguments the tool does not take
    assert env.step("Action: 7") == envs.StepResult(tool_calls.CALL_FORMAT, 0.0, False, {"valid": False})
    wrong = env.step('Action: {"tool": "guess_toolset_guess", "arguments": {"number": "7"}}')
    assert wrong == envs.StepResult("Error: the argument 'number' of guess_toolset_guess must be an integer, not a "
                                    "string", 0.0, False, {"valid": False})
    # a tool that fails, and one there is not: one sentence each, the episode goes on
    assert env.step(vf_call("guess_toolset_guess", number=9)).observation == ("Error executing tool guess: 9 is not a "
                                                                              "number from 1 to 8")
    assert env.step('Action: {"tool": "shout", "arguments": {}}').observation == (
        "Error: there is no tool 'shout'; the tools are guess_toolset_guess, guess_toolset_parity, final_answer.")
    assert env.step(vf_call("final_answer", answer="7")) == envs.StepResult(END, 1.0, True, {})
    trace = env.seat.trace  # (what the rubric scored: the state the server wrote, the calls and their results)
    assert trace.state.guesses == 1 and trace.metrics == {"guesses": 1.0} and trace.last_reply == "7"
    assert [type(node.message).__name__ for node in trace.nodes] == [
        "SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage", "AssistantMessage", "ToolMessage",
        "AssistantMessage", "ToolMessage", "AssistantMessage", "ToolMessage", "AssistantMessage"]
    env.close()


def test_an_image_a_tool_returns_is_one_line_of_the_observation_and_whole_on_the_trace():
    """A tool whose result holds a PNG (tests/guess_vftools.py's camera): the observation is its text and one line for
    the image, not the image's base64 (4,000 characters here, megabytes for a screenshot); the trace the rubric reads
    holds the result as verifiers' harness gives it to a model, the image an image part."""
    import base64

    from guess_vftools import PNG

    env = envs.make(VF, task={"pictures": True})
    env.reset(6)
    picture = env.step('Action: {"tool": "camera_picture", "arguments": {}}')
    assert picture == envs.StepResult("Here it is:\n[an image (image/png), not shown: the model here reads text]", 0.0,
                                      False, {})
    result = env.seat.trace.nodes[-1].message.model_dump()
    assert result["content"] == [{"type": "text", "text": "Here it is:"}, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}]
    assert env.step(vf_call("guess_toolset_guess", number=7)).observation == "Correct!"  # (text as it was)
    env.close()


def test_an_image_in_an_openenv_tools_result_is_one_line_of_the_observation():
    """The OpenEnv adapter's CallToolObservation (MCP's content, serialized): an image item is one line as the verifiers
    adapter's, not its JSON with the base64."""
    fields = {"result": {"content": [{"type": "text", "text": "Here it is:"},
                                     {"type": "image", "data": "iVBORw0KGgo" + "A" * 4000, "mimeType": "image/png"}]}}
    assert adapter.result_text(fields) == "Here it is:\n[an image (image/png), not shown: the model here reads text]"


def test_a_task_id_replays_its_verifiers_episode_and_a_stop_hook_ends_it():
    env = envs.make(VF)
    replies = [vf_call("guess_toolset_guess", number=n) for n in (4, 6)] + [vf_call("final_answer", answer="7")]
    for task_id in (0, 6, 13):
        episode = play(env, task_id, replies)
        assert play(env, task_id, replies) == episode
        assert episode[-1].done and episode[-1].reward == float(task_id % 8 + 1 == 7)
    # the task's @vf.stop: three guesses, and the episode ends (scored: no final answer, 0)
    stopped = play(env, 6, [vf_call("guess_toolset_guess", number=n) for n in (1, 2, 3, 4)])
    assert [r.observation for r in stopped[1:]] == ["Higher.", "Higher.", END] and stopped[-1].reward == 0.0
    assert env.seat.trace.stop_condition == "out_of_guesses"
    env.close()


def test_a_react_agent_on_a_taskset_with_tools_is_told_them_and_the_line():
    from rl.agent import make_agent

    env = envs.make(VF)
    instruction = make_agent("react").instruction(env)
    assert instruction.startswith("Find the secret number from 1 to 8 with the tools, then give it as your final "
                                  "answer.\n\nYou act by calling one of these tools")
    for line in ("- guess_toolset_guess(number: integer): Guess the secret number.",
                 "- guess_toolset_parity(): Whether the secret number is even or odd.",
                 "- final_answer(answer: string): Give your final answer, which the task is scored on; it ends your "
                 "turn."):
        assert f"\n{line}\n" in instruction
    example = vf_call("guess_toolset_guess", number=1)
    assert instruction.endswith(f"Thought: I think ...\n{example}")
    env.reset(6)
    assert env.step(f"Thought: low first.\n{example}").observation == "Higher."
    env.close()


def test_a_tool_server_that_cannot_run_here_is_refused_in_one_sentence(monkeypatch):
    from envs.guard import make_envs
    from envs.standards import verifiers as adapter

    with pytest.raises(SystemExit, match=r"^cannot make a verifiers:guess_vftools env with options .*: ValueError: "
                                         r"the tool server guess_toolset runs at http://127.0.0.1:9/mcp, outside "
                                         r"verifiers"):
        make_envs(VF, 1, {"task": {"tools": {"url": "http://127.0.0.1:9/mcp"}}})
    import guess_vftools as module  # (the module verifiers imported the taskset from)

    monkeypatch.setattr(module.GuessToolset, "TOOL_PREFIX", None)  # (bare names: a final_answer of its own clashes)
    monkeypatch.setattr(module.GuessToolset, "final_answer", vf.tool(lambda self, answer: answer, name="final_answer"),
                        raising=False)
    with pytest.raises(ValueError, match=r"^verifiers:guess_vftools: its tools cannot be listed: ValueError: the "
                                         r"taskset's tool servers give more than one tool the name final_answer"):
        adapter.tools.__wrapped__("guess_vftools")


def test_a_rollout_of_tool_calls_plays_a_tasksets_episode_to_its_rubrics_score():
    """The tools agent's turns, sampled as tokens in the template's call format: each call's result is the next
    observation, and final_answer ends the episode with the rubric's score as its reward."""
    from rl.agent import make_agent
    from rl.chat import ChatFormat
    from rl.engines import RoundEngine, Sample
    from rl.model import load_tokenizer
    from rollout import rollout

    fmt = ChatFormat(load_tokenizer("tiny-agent-tools"))
    calls = [("guess_toolset_guess", {"number": 4}), ("guess_toolset_parity", {}), ("final_answer", {"answer": "7"})]
    replies = [f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
               for name, arguments in calls]

    class Scripted(RoundEngine):
        def generate(self, batch, limits):
            return [Sample(ids, [0.0] * len(ids)) for ids in
                    (fmt.encode(replies[traj.turns]) + [fmt.end_of_turn] for traj in batch)]

    env = envs.make(VF)
    [traj] = rollout(Scripted(), fmt, [env], [6], [0], horizon=4, max_new_tokens=64, max_tokens=4096,
                     agent=make_agent("tools"))
    assert traj.error is None and (traj.turns, traj.reward, traj.invalid_actions) == (3, 1.0, 0)
    assert traj.actions == [env_tools.action_text(VF, name, arguments) for name, arguments in calls]
    assert [m["content"] for m in traj.messages[3:] if m["role"] == "tool"] == ["Higher.", "odd", END]
    env.close()
