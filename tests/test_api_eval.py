"""eval.py --model openai:<name> (rl/engines/api.py), against real HTTP servers on loopback.

- vLLM's own OpenAI-compatible server, started here on the embedded model: greedy episodes score the same
  tasks as the in-process engine (the same conversations, word for word), and a prompt past its context
  window ends the episode as out of room.
- A small server in this file that fails on purpose: every turn answered 503 twice before a reply (retried
  with backoff, Retry-After honoured), a refusal (4xx) that ends only its episode, a full context window,
  a server that fails every request after its check, one that refuses the key and one that cannot be
  reached (both stop the eval before any episode, writing nothing); token usage and cost per episode and
  summed; the API key in no file and no output, even when the server echoes it back.
- Servers with a model that thinks and calls tools: the trajectory's tools go out (only when it has some), the
  reply's tool calls come back unparsed, malformed ones too; its separate reasoning and reasoning tokens are read
  and summed; a hosted reasoning model's refusals of max_tokens, temperature and top_p are learnt once and every
  turn still plays, and eval.py records the temperature it really played at.
- A server without a reasoning parser, whose replies hold the reasoning and only </think>: the env reads the
  answer after the last closing tag, the reasoning is logged as reasoning_content; replies cut off inside the
  reasoning or without any tag.
"""

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

import envs
import eval as eval_script
from rl.flags import build
from rl.engines.api import APIEngine, total_usage
from rl.model import EMBEDDED
from rl.scores import spread
from rollout import Trajectory

WINDOW = 4096  # the server's context window, and the trajectory budget of both sides of the comparison
KEY = "sk-test-never-written-7d1e5a"  # a fake API key: must appear in no file and no output
REPLY = "Thought: I should look around.\nAction: turn left"


# ----------------------------------------------------------------------------------------------
# vLLM's OpenAI-compatible server on the embedded model, started once for the module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `python -m vllm.entrypoints.openai.api_server` process; `url()` waits until it answers."""

    def __init__(self, log: Path, model: str = "tiny-agent", *flags: str):
        self.port, self.log = free_port(), log
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with open(log, "w") as out:  # (the vllm CLI, `vllm serve`, fails on vllm-cpu's package metadata)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(EMBEDDED[model]),
                 "--served-model-name", model, "--host", "127.0.0.1", "--port", str(self.port),
                 "--dtype", "float32", "--max-model-len", str(WINDOW), "--enforce-eager", "--seed", "0", *flags],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ready = False

    def url(self, timeout: float = 240.0) -> str:
        url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + timeout
        while not self.ready:
            if self.process.poll() is not None:
                pytest.fail(f"the vLLM server exited ({self.process.returncode}):\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url + "/models", timeout=2).close()
                self.ready = True
            except OSError:
                time.sleep(1)
        return url

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and its engine-core process
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None and not os.environ.get("CI"):
        pytest.skip("vLLM is not installed here (setup.sh installs it; CI runs these)")
    server = Served(tmp_path_factory.mktemp("vllm") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served_tools(tmp_path_factory):
    """The tool-calling agent (assets/tiny-agent-tools) behind vLLM's server with its Hermes tool parser."""
    if importlib.util.find_spec("vllm") is None and not os.environ.get("CI"):
        pytest.skip("vLLM is not installed here (setup.sh installs it; CI runs these)")
    server = Served(tmp_path_factory.mktemp("vllm-tools") / "server.log", "tiny-agent-tools",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield server
    server.stop()


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_greedy_api_episodes_are_the_in_process_engines(served, tmp_path):
    """The same model behind vLLM's server, greedy, plays 12 BabyAI test tasks exactly as eval.py's own vLLM
    engine does: per-task success and every reply are identical. The budget is the server's window on both
    sides, which these episodes never reach, so it does not bind."""
    common = dict(env="babyai", protocol="tiny", max_tokens=WINDOW, limit=12, temperature=0.0)
    # (the in-process run first: it overlaps the server's start-up)
    local = eval_script.main(build(eval_script.Args, model="tiny-agent", engine="vllm", out=str(tmp_path / "local"), **common))
    remote = eval_script.main(build(eval_script.Args, model="openai:tiny-agent", base_url=served.url(),
                                               out=str(tmp_path / "api"), **common))
    mine, theirs = records(tmp_path / "local"), records(tmp_path / "api")
    assert [r["task_id"] for r in mine] == [r["task_id"] for r in theirs]
    assert [r["success"] for r in theirs] == [r["success"] for r in mine]
    assert 0 < sum(r["success"] for r in mine) < len(mine)  # a comparison with both outcomes in it
    assert [r["messages"] for r in theirs] == [r["messages"] for r in mine]
    assert [r["finish"] for r in theirs] == [r["finish"] for r in mine] and all(r["error"] is None for r in theirs)
    assert remote["avg@k"] == local["avg@k"] and remote["categories"] == local["categories"]
    assert remote["engine"] == "api" and remote["base_url"] == served.url() and local["engine"] == "vllm"

    # no tokens on an API episode; the server's counts instead, one call a turn, summed in the results
    assert all(r["tokens"] == 0 and r["action_spans"] == [] for r in theirs)
    assert all(r["usage"]["calls"] == r["turns"] and r["usage"]["prompt_tokens"] > r["turns"] * 500 for r in theirs)
    for key in ("calls", "prompt_tokens", "completion_tokens"):
        assert remote["usage"][key] == sum(r["usage"][key] for r in theirs)
    # a one-turn episode's call: the prompt is the in-process engine's first prompt, the reply its sampled turn
    first = next(i for i, r in enumerate(theirs) if r["turns"] == 1)
    assert theirs[first]["usage"]["prompt_tokens"] + theirs[first]["usage"]["completion_tokens"] == mine[first]["tokens"]


@pytest.mark.slow
def test_greedy_tool_calls_through_the_server_are_the_in_process_engines(served_tools, tmp_path):
    """The tool-calling agent behind vLLM's server (its Hermes parser returns the calls apart from the text), greedy,
    on 8 BabyAI test tasks under --agent tools, against eval.py's own engine, which reads the calls from the sampled
    text. The server renders the whole conversation every turn, which is --reasoning drop's layout: played so, the
    in-process engine makes the same calls and gets the same answers and successes, turn for turn, and the tools are
    rendered alike (a one-turn episode's counts are the local trajectory's tokens). (Under keep, the default, the two
    part after some turns: the server's prompt is a new tokenization of the conversation, and the tokens the
    in-process engine appended need not be the tokenizer's own spelling of their text.)"""
    common = dict(env="babyai", protocol="tiny", agent="tools", max_tokens=WINDOW, limit=8, temperature=0.0)
    local = eval_script.main(build(eval_script.Args, model="tiny-agent-tools", engine="vllm", reasoning="drop",
                                              out=str(tmp_path / "local"), **common))
    remote = eval_script.main(build(eval_script.Args, model="openai:tiny-agent-tools", base_url=served_tools.url(),
                                               out=str(tmp_path / "api"), **common))
    mine, theirs = records(tmp_path / "local"), records(tmp_path / "api")

    def calls(record):
        return [[(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])]
                for m in record["messages"][3::2]]

    assert [calls(r) for r in theirs] == [calls(r) for r in mine] and all(calls(r)[0] for r in mine)
    assert [r["messages"][4::2] for r in theirs] == [r["messages"][4::2] for r in mine]  # (tool results, ids and all)
    assert [r["success"] for r in theirs] == [r["success"] for r in mine] and any(r["success"] for r in mine)
    assert remote["avg@k"] == local["avg@k"] and remote["malformed"] == local["malformed"] < 0.2
    assert local["agent"] == "tools" and local["reasoning"] == "drop" and (remote["engine"], local["engine"]) == ("api", "vllm")
    one = [i for i, r in enumerate(theirs) if r["turns"] == 1]
    assert one and all(theirs[i]["usage"]["prompt_tokens"] + theirs[i]["usage"]["completion_tokens"] == mine[i]["tokens"]
                       for i in one)


@pytest.mark.slow
def test_a_prompt_past_the_servers_window_ends_the_episode_as_out_of_room(served):
    engine = APIEngine(served.url(), "tiny-agent", temperature=0.0, retries=0)
    traj = Trajectory("babyai", 0, 0, 0, [{"role": "user", "content": "go to the red ball " * 1000}])
    try:
        engine.submit(traj, 16)
        [(same, sample)] = engine.poll()
    finally:
        engine.close()
    assert same is traj and sample.finish == "max_tokens" and sample.error is None and sample.text is None


# ----------------------------------------------------------------------------------------------
# A server that fails on purpose


@contextlib.contextmanager
def fake_api(answer, listing=(200, {"object": "list", "data": [{"id": "fake-model"}]})):
    """An OpenAI-compatible endpoint on loopback: GET /v1/models answers `listing` (status, payload); each chat
    request is answered by answer(body, attempt, authorization) -> (status, payload or its bytes, headers), attempt counting
    the times this very body has arrived. Yields (base URL, [(authorization, body, time) of every request])."""
    seen, lock = [], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send(*listing, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            authorization = self.headers.get("Authorization")
            with lock:
                seen.append((authorization, body, time.monotonic()))
                attempt = sum(other == body for _, other, _ in seen)
            self.send(*answer(body, attempt, authorization))

        def send(self, status, payload, headers):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()  # (bytes: sent as they are)
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def reply(text=REPLY, prompt_tokens=100, completion_tokens=10):
    return 200, {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                           "message": {"role": "assistant", "content": text}}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}, {}


def api_args(url: str, out: Path, **flags) -> eval_script.Args:
    return build(eval_script.Args, model="openai:fake-model", base_url=url, env="babyai", protocol="tiny", limit=4, horizon=2,
                            api_key_env="AGENTGYM_RL_TEST_KEY", api_backoff=0.01, api_concurrency=3, out=str(out),
                            **flags)


def first_observations(count: int) -> list[str]:
    """The first observation of each task eval.py plays with --limit count (BabyAI's test split)."""
    env = envs.make("babyai")
    try:
        return [env.reset(task) for task in spread(envs.splits("babyai")["test"], count)]
    finally:
        env.close()


@pytest.mark.slow  # (waits out its retries' back-off)
def test_retries_refusals_usage_and_a_key_that_is_never_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTGYM_RL_TEST_KEY", KEY)
    refused, full = first_observations(4)[1:3]

    def answer(body, attempt, authorization):
        if attempt == 1:
            return 503, {"error": {"message": "overloaded"}}, {"Retry-After": "1"}
        if attempt == 2:
            return 503, {"error": {"message": "still overloaded"}}, {}  # backoff only
        observation, turn = body["messages"][2]["content"], len(body["messages"]) // 2
        if observation == refused and turn == 2:  # a refusal that echoes the key, as some APIs do
            return 400, {"error": {"message": f"Invalid request for key {authorization.split()[-1]}"}}, {}
        if observation == full:  # vLLM's words for a prompt past its window
            return 400, {"error": {"message": "This model's maximum context length is 4096 tokens. However, your "
                                              "prompt contains at least 4097 input tokens"}}, {}
        return reply()

    with fake_api(answer) as (url, seen):
        results = eval_script.main(api_args(url, tmp_path / "run", price_in=2.0, price_out=8.0))
    episodes = records(tmp_path / "run")

    # every turn came back after two 503s: the same request three times, the first retry after Retry-After
    bodies = [json.dumps(body, sort_keys=True) for _, body, _ in seen]
    assert all(bodies.count(body) == 3 for body in bodies), "every request was sent three times"
    for body in set(bodies):
        times = [at for (_, _, at), other in zip(seen, bodies) if other == body]
        assert times[1] - times[0] >= 1.0  # Retry-After: 1, though the backoff is 0.01 s
    assert {authorization for authorization, _, _ in seen} == {f"Bearer {KEY}"}
    assert all(body["model"] == "fake-model" and body["max_tokens"] == 48 for _, body, _ in seen)

    by_observation = {r["messages"][2]["content"]: r for r in episodes}
    bad, cut = by_observation.pop(refused), by_observation.pop(full)
    assert bad["finish"] == "error" and bad["turns"] == 1 and "HTTP 400" in bad["error"] and "key ***" in bad["error"]
    assert cut["finish"] == "max_tokens" and cut["error"] is None and cut["turns"] == 0
    assert all(r["finish"] == "horizon" and r["turns"] == 2 and r["error"] is None for r in by_observation.values())
    assert all(r["messages"][3]["content"] == REPLY for r in by_observation.values())
    assert results["errors"] == 1 and results["tasks"] == 4

    # usage: the server's counts of every answered call, cost at $2 and $8 per million tokens, summed
    for r in episodes:
        assert r["usage"] == {"calls": r["turns"], "prompt_tokens": 100 * r["turns"],
                              "completion_tokens": 10 * r["turns"], "reasoning_tokens": 0,
                              "cost": pytest.approx(r["turns"] * 280e-6)}
    assert results["usage"] == {"calls": 5, "prompt_tokens": 500, "completion_tokens": 50, "reasoning_tokens": 0,
                                "cost": 0.0014}
    assert results["prices"] == {"in": 2.0, "out": 8.0} and results["base_url"] == url

    printed = capsys.readouterr()
    written = [path.read_text() for path in tmp_path.rglob("*") if path.is_file()]
    assert len(written) == 2 and "Bearer" not in "".join(written)
    assert all(KEY not in text for text in [*written, printed.out, printed.err])


def test_a_server_that_fails_every_request_fails_every_episode_and_still_writes_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTGYM_RL_TEST_KEY", KEY)
    def answer(body, attempt, authorization):
        return 500, {"error": {"message": "the GPU caught fire"}}, {}

    with fake_api(answer) as (url, seen):
        results = eval_script.main(api_args(url, tmp_path / "down", api_retries=1))
    assert len(seen) == 4 * 2  # the first turn of each episode, tried twice
    assert results["errors"] == 4 and results["avg@k"] == 0 and results["usage"]["calls"] == 0
    assert all(r["finish"] == "error" and r["error"] == "api: HTTP 500 Internal Server Error: the GPU caught fire "
                                                       "(after 2 attempts)" for r in records(tmp_path / "down"))
    assert "first failure: api: HTTP 500" in capsys.readouterr().out


def test_a_refused_key_stops_the_eval_before_any_episode_and_is_not_repeated(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTGYM_RL_TEST_KEY", KEY)
    listing = (401, {"error": {"message": f"Incorrect API key provided: {KEY}"}})
    with fake_api(reply, listing) as (url, seen), pytest.raises(SystemExit) as stop:
        eval_script.main(api_args(url, tmp_path / "refused"))
    assert f"{url} refused the API key: HTTP 401 Unauthorized: Incorrect API key provided: ***" in str(stop.value)
    assert KEY not in str(stop.value) + "".join(capsys.readouterr()) and not seen and not any(tmp_path.iterdir())


def test_a_server_that_cannot_be_reached_stops_the_eval_before_any_episode(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(SystemExit, match=f"cannot reach {url}: ConnectionRefusedError"):
        eval_script.main(api_args(url, tmp_path / "nothing"))
    assert not any(tmp_path.iterdir())


def test_reflect_through_an_api_counts_its_reflections_and_survives_a_full_window(tmp_path):
    """--agent reflect on an API model: every reflection call is in the episode's usage, and a reflection request
    the window refuses (the attempt's whole conversation and one more turn) ends that task's attempts, nothing else."""
    from rl.agent import REFLECT_ASK

    refuse = {"on": False}

    def answer(body, attempt, authorization):
        if REFLECT_ASK in body["messages"][-1]["content"]:
            if refuse["on"]:
                return 400, {"error": {"message": "This model's maximum context length is 4096 tokens."}}, {}
            return reply("I kept going the wrong way.", prompt_tokens=300, completion_tokens=7)
        return reply("Thought:\nx\n\nAction:\nturn left")  # never solves a task

    for refused in (False, True):
        refuse["on"] = refused
        with fake_api(answer) as (url, seen):
            results = eval_script.main(api_args(url, tmp_path / f"r{refused}", agent="reflect", attempts=2))
        episodes = records(tmp_path / f"r{refused}")
        assert results["usage"]["calls"] == len(seen) - refused * 4  # (a refused request is no answered call)
        assert sum(r["usage"]["calls"] for r in episodes) == results["usage"]["calls"]
        assert [r.get("attempt", 1) for r in episodes] == ([1] * 4 + [2] * 4 if not refused else [1] * 4)
        if not refused:
            assert [r["reflection"] for r in episodes[:4]] == ["I kept going the wrong way."] * 4


# ----------------------------------------------------------------------------------------------
# A model that thinks and calls tools


TOOLS = [{"type": "function", "function": {"name": "go", "description": "Walk to an object.",
                                            "parameters": {"type": "object", "properties": {"to": {"type": "string"}},
                                                           "required": ["to"]}}}]
MAX_TOKENS_REFUSED = ("Unsupported parameter: 'max_tokens' is not supported with this model. "
                      "Use 'max_completion_tokens' instead.")  # OpenAI's words, for o1 to GPT-5
TEMPERATURE_REFUSED = ("Unsupported value: 'temperature' does not support {} with this model. "
                       "Only the default (1) value is supported.")
TOP_P_REFUSED = "Unsupported parameter: 'top_p' is not supported with this model."


def refusal(message: str, param: str):
    return 400, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                           "code": "unsupported_parameter"}}, {}


def turns(engine: APIEngine, trajectories: list, limit: int = 32) -> list:
    """Each trajectory's next turn, submitted together: the Samples in the trajectories' order."""
    for traj in trajectories:
        engine.submit(traj, limit)
    samples = {}
    while engine.pending:
        samples |= {id(traj): sample for traj, sample in engine.poll()}
    return [samples[id(traj)] for traj in trajectories]


def test_tools_go_out_with_the_trajectory_and_tool_calls_come_back_unparsed():
    """A trajectory with tools sends them (and its assistant tool calls and tool answers as they are); one without
    sends none. The reply's tool calls come back as the server wrote them, the malformed ones too."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "go", "arguments": '{"to": "red ball"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "go", "arguments": '{"to": "red'}},  # bad JSON
             {"id": "call_3", "type": "function", "function": {"arguments": "{}"}},  # no name
             {"type": "function", "function": {"name": "go", "arguments": None}}]  # no id, null arguments

    def answer(body, attempt, authorization):
        if "tools" not in body:
            return reply()
        return 200, {"choices": [{"index": 0, "finish_reason": "tool_calls",
                                  "message": {"role": "assistant", "content": None, "tool_calls": calls}}],
                     "usage": {"prompt_tokens": 120, "completion_tokens": 30}}, {}

    earlier = {"id": "call_0", "type": "function", "function": {"name": "go", "arguments": '{"to": "door"}'}}
    with_tools = Trajectory("babyai", 0, 0, 0, [{"role": "user", "content": "Go to the red ball."},
                                                {"role": "assistant", "content": None, "tool_calls": [earlier]},
                                                {"role": "tool", "tool_call_id": "call_0", "content": "At the door."}])
    with_tools.tools = TOOLS
    plain = Trajectory("babyai", 1, 1, 1, [{"role": "user", "content": "Go to the red ball."}])
    with fake_api(answer) as (url, seen):
        engine = APIEngine(url, "fake-model", retries=0)
        try:
            called, replied = turns(engine, [with_tools, plain])
        finally:
            engine.close()

    sent = {len(body["messages"]): body for _, body, _ in seen}
    assert len(seen) == 2 and sent[3]["tools"] == TOOLS and sent[3]["messages"] == with_tools.messages
    assert "tools" not in sent[1] and not {"tool_choice"} & (sent[1].keys() | sent[3].keys())
    assert called.error is None and called.text == "" and called.tool_calls == [
        {"id": "call_1", "name": "go", "arguments": '{"to": "red ball"}'},
        {"id": "call_2", "name": "go", "arguments": '{"to": "red'},
        {"id": "call_3", "name": "", "arguments": "{}"},
        {"id": "", "name": "go", "arguments": ""}]
    assert replied.error is None and replied.text == REPLY and replied.tool_calls is None


def test_reasoning_and_its_tokens_are_read_and_summed():
    """reasoning_content (or `reasoning`, as vLLM's newer servers name it) is Sample.reasoning, never its text; the
    reasoning tokens the server counts go to the usage, 0 where it counts none, and total_usage sums them."""
    def answer(body, attempt, authorization):
        status, payload, headers = reply()
        message, usage = payload["choices"][0]["message"], payload["usage"]
        asked = body["messages"][-1]["content"]
        if asked == "reasoning_content":
            message["reasoning_content"] = "The ball is left of me."
            usage["completion_tokens_details"] = {"reasoning_tokens": 7}
        elif asked == "reasoning":
            message["reasoning"] = "The ball is behind me."
            usage["completion_tokens_details"] = {"reasoning_tokens": None, "accepted_prediction_tokens": 0}
        return status, payload, headers

    trajectories = [Trajectory("babyai", i, i, i, [{"role": "user", "content": name}])
                    for i, name in enumerate(("reasoning_content", "reasoning", "neither"))]
    with fake_api(answer) as (url, seen):
        engine = APIEngine(url, "fake-model", retries=0)
        try:
            samples = turns(engine, trajectories)
        finally:
            engine.close()

    assert [s.reasoning for s in samples] == ["The ball is left of me.", "The ball is behind me.", None]
    assert [s.text for s in samples] == [REPLY] * 3
    assert [s.usage["reasoning_tokens"] for s in samples] == [7, 0, 0]
    episodes = [SimpleNamespace(usage=s.usage) for s in samples]
    assert total_usage(episodes) == {"calls": 3, "prompt_tokens": 300, "completion_tokens": 30, "reasoning_tokens": 7,
                                     "cost": 0.0}
    assert total_usage([])["reasoning_tokens"] == 0


def openai_reasoning_model(body, attempt, authorization):
    """OpenAI's o-series and GPT-5 on chat completions: no max_tokens, no top_p, temperature 1 only."""
    if "max_tokens" in body:
        return refusal(MAX_TOKENS_REFUSED, "max_tokens")
    if body.get("temperature", 1) != 1:
        return refusal(TEMPERATURE_REFUSED.format(body["temperature"]), "temperature")
    if "top_p" in body:
        return refusal(TOP_P_REFUSED, "top_p")
    return reply()


def test_a_reasoning_model_that_refuses_max_tokens_and_temperature_is_adapted_to_once():
    """One refusal per parameter, each resent at once (no retry, no failure), and every later request goes out as the
    server takes it: max_completion_tokens in place of max_tokens, no temperature or top_p; the seed stays."""
    traj = Trajectory("babyai", 0, 0, 0, [{"role": "user", "content": "Go to the red ball."}])
    with fake_api(openai_reasoning_model) as (url, seen):
        engine = APIEngine(url, "fake-model", temperature=0.7, concurrency=1, retries=0)
        try:
            samples = []
            for turn in range(3):
                traj.turns = turn
                samples += turns(engine, [traj], limit=48)
            counts, sampling, refused = engine.metrics(), engine.sampling, engine.refused
        finally:
            engine.close()

    assert all(s.error is None and s.text == REPLY for s in samples)
    sent = [{key for key in body if key in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed")}
            for _, body, _ in seen]
    assert sent == [{"max_tokens", "temperature", "top_p", "seed"},  # refused for max_tokens
                    {"max_completion_tokens", "temperature", "top_p", "seed"},  # for temperature
                    {"max_completion_tokens", "top_p", "seed"},  # for top_p
                    *[{"max_completion_tokens", "seed"}] * 3]  # answered: the first turn, then the next two at once
    assert all(body.get("max_completion_tokens", body.get("max_tokens")) == 48 for _, body, _ in seen)
    assert len({body["seed"] for _, body, _ in seen[3:]}) == 3  # one seed a turn, as before the refusals
    assert counts == {"requests": 6, "retries": 0, "adapted": 3, "failed_turns": 0}
    assert sampling == {"temperature": 1.0, "top_p": 1.0} and refused == {"max_tokens", "temperature", "top_p"}


def test_a_refusal_of_anything_else_is_neither_adapted_to_nor_retried():
    refusals = {"developer": ("Unsupported value: 'messages[0].role' does not support 'developer' with this model.",
                              "messages[0].role"),
                "zero": ("Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead.",
                         "max_tokens")}

    def answer(body, attempt, authorization):
        return refusal(*refusals[body["messages"][-1]["content"]])

    trajectories = [Trajectory("babyai", i, i, i, [{"role": "user", "content": name}])
                    for i, name in enumerate(refusals)]
    with fake_api(answer) as (url, seen):
        engine = APIEngine(url, "fake-model", temperature=0.0, retries=2, backoff=0.01)
        try:
            samples = turns(engine, trajectories)
            counts, sampling = engine.metrics(), engine.sampling
        finally:
            engine.close()
    assert len(seen) == 2 and all(s.error.startswith("api: HTTP 400 Bad Request: ") for s in samples)
    assert counts == {"requests": 2, "retries": 0, "adapted": 0, "failed_turns": 2}
    assert sampling == {"temperature": 0.0, "top_p": 1.0} and not engine.refused


def test_eval_records_the_temperature_a_reasoning_model_really_played_at(tmp_path, capsys):
    """Asked for greedy episodes, a model that takes only temperature 1 plays every turn at 1 (three requests in
    flight, each of which may meet a refusal first); the result says 1, what was asked, and what the server refused,
    and the summary warns. Its reasoning tokens are summed."""
    def answer(body, attempt, authorization):
        status, payload, headers = openai_reasoning_model(body, attempt, authorization)
        if status == 200:
            payload["usage"]["completion_tokens_details"] = {"reasoning_tokens": 6}
        return status, payload, headers

    with fake_api(answer) as (url, seen):
        results = eval_script.main(api_args(url, tmp_path / "o", temperature=0.0))
    episodes = records(tmp_path / "o")
    assert all(r["finish"] == "horizon" and r["turns"] == 2 and r["error"] is None for r in episodes)
    first_turns = [body for _, body, _ in seen if len(body["messages"]) == 3]
    assert 1 <= sum("max_tokens" in body for body in first_turns) <= 3  # (one a thread at most)
    assert all("max_completion_tokens" in body and "temperature" not in body and "top_p" not in body
               for _, body, _ in seen if len(body["messages"]) > 3)  # second turns go out adapted
    written = json.loads((tmp_path / "o.json").read_text())
    for result in (results, written):
        assert result["temperature"] == 1.0 and result["top_p"] == 1.0
        assert result["asked"] == {"temperature": 0.0, "top_p": 1.0}
        assert result["refused"] == ["max_tokens", "temperature", "top_p"]
        assert result["usage"]["reasoning_tokens"] == 6 * 8 and result["usage"]["calls"] == 8
    out = capsys.readouterr().out
    assert "80 completion tokens (48 of them reasoning)" in out
    assert "played at temperature 1.0 and top_p 1.0, not the asked 0.0 and 1.0" in out


# ----------------------------------------------------------------------------------------------
# A reasoning model served without a reasoning parser (R1 distills, Qwen3-Thinking): the template opened <think> in
# the generation prompt, so `content` holds the reasoning and only the closing tag


THOUGHT = "I think the ball is ahead. Action: go forward would be wrong here.\n"


def test_reasoning_left_in_the_reply_is_logged_as_reasoning_and_never_reaches_the_env(tmp_path):
    """Every reply is reasoning with a decoy "Action:", </think>, then the answer: the env reads only the answer (each
    turn valid, not "Only one 'Action' is allowed"), the reasoning is the message's reasoning_content, and the next
    turn sends the answer back without it, as to a server with a reasoning parser."""
    with fake_api(lambda body, attempt, authorization: reply(THOUGHT + "</think>\n\n" + REPLY)) as (url, seen):
        results = eval_script.main(api_args(url, tmp_path / "r1"))
    episodes = records(tmp_path / "r1")
    assert envs.REACT_ONLY_ONE not in {m["content"] for r in episodes for m in r["messages"][4::2]}  # (env answers)
    assert [(r["finish"], r["turns"], r["invalid_actions"]) for r in episodes] == [("horizon", 2, 0)] * 4
    assert all(r["env_actions"] == [REPLY] * 2 for r in episodes)
    for r in episodes:
        assert r["messages"][3::2] == [{"role": "assistant", "content": REPLY, "reasoning_content": THOUGHT}] * 2
    assert all(body["messages"][3] == {"role": "assistant", "content": REPLY}
               for _, body, _ in seen if len(body["messages"]) == 5)
    assert results["malformed"] == 0 and results["errors"] == 0


def test_reasoning_cut_off_several_closing_tags_and_no_tags_from_a_server(tmp_path):
    """One reply kind a task: several closing tags (the answer follows the last one); opened and never closed (cut
    off inside the reasoning: kept whole, answered as an invalid action without the env); no tags at all (the reply,
    since a server's template is unknown here); a separate reasoning_content with the answer alone (as before)."""
    kinds = dict(zip(first_observations(4), [
        ("<think>I may write </think> inside my reasoning. " + THOUGHT + "</think>\n\n" + REPLY, None),
        ("<think>" + THOUGHT + "and I am still thinking", None),
        (REPLY, None),
        (REPLY, THOUGHT)]))

    def answer(body, attempt, authorization):
        content, reasoning = kinds[body["messages"][2]["content"]]
        status, payload, headers = reply(content)
        if reasoning:
            payload["choices"][0]["message"]["reasoning_content"] = reasoning
        return status, payload, headers

    with fake_api(answer) as (url, seen):
        eval_script.main(api_args(url, tmp_path / "kinds"))
    several, cut, plain, separate = [next(r for r in records(tmp_path / "kinds") if r["messages"][2]["content"] == o)
                                     for o in kinds]
    assert several["env_actions"] == [REPLY] * 2 and several["invalid_actions"] == 0
    assert several["messages"][3] == {"role": "assistant", "content": REPLY,
                                      "reasoning_content": "I may write </think> inside my reasoning. " + THOUGHT}
    assert cut["env_actions"] == [None, None] and cut["invalid_actions"] == cut["malformed"] == 2
    assert cut["messages"][3] == {"role": "assistant", "content": kinds[cut["messages"][2]["content"]][0]}
    assert "ended inside its reasoning, before </think>" in cut["messages"][4]["content"]
    for r in (plain, separate):
        assert r["env_actions"] == [REPLY] * 2 and r["invalid_actions"] == 0
    assert plain["messages"][3] == {"role": "assistant", "content": REPLY}
    assert separate["messages"][3] == {"role": "assistant", "content": REPLY, "reasoning_content": THOUGHT}
