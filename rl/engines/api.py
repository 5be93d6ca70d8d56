"""Models behind an OpenAI-compatible chat endpoint (a hosted API, or a served checkpoint) as a rollout engine.

    python eval.py --model openai:gpt-4o --base-url https://api.openai.com/v1 --env babyai   # key: $OPENAI_API_KEY
    python -m vllm.entrypoints.openai.api_server --model runs/<run>/checkpoints/step_8 --served-model-name step8 \\
        --port 8000 --max-model-len 32768
    python eval.py --model openai:step8 --base-url http://127.0.0.1:8000/v1

APIEngine honours rl/engines' contract (submit / poll / pending / continuous / abort / close / metrics), so
an API model plays through rollout.py's own loop, with the same envs, turn caps, splits and scores as a local
one. It is text in, text out: each turn POSTs the trajectory's messages (the chat so far, which rollout.py
keeps) to {base_url}/chat/completions and hands the reply's text back as Sample(text=...). The server applies
its own chat template. There are no token ids: an API trajectory's token_ids, loss mask and log-probs stay
empty (nothing is trained on it), and APIFormat stands in for ChatFormat, which stays the only place that
turns messages into tokens.

Tools and reasoning. A trajectory that carries tools (`traj.tools`: OpenAI function schemas) sends them with
every request, and its messages go as the rollout keeps them, an assistant's `tool_calls` and the `tool`
answers included. A reply's tool calls come back in Sample.tool_calls ({"id", "name", "arguments"}, the
arguments the JSON text exactly as the server sent it, "" for what an entry lacks), unparsed and never refused
here: the rollout parses them and answers a malformed one (keeping calls it cannot take as the message's
`invalid_tool_calls`, for the logs and the viewer; never sent back). Only the reply's `content` is its text
(Sample.text, "" when a reply holds only tool calls), so only that can reach the env. A reasoning model's separate
reasoning (`reasoning_content`, or `reasoning` as some servers name it) is Sample.reasoning: the rollout logs it with
the episode and keeps it out of the env and out of the messages sent back in later turns, since the env should read
the answer after the reasoning. A server without a reasoning parser leaves the reasoning in `content`, and for a
template that opens the block in its generation prompt (R1 distills, Qwen3-Thinking) with only the closing tag:
such a reply is read by rl/chat.py's rule (Reasoning.split: the text after the last closing tag is the answer),
its answer becomes Sample.text and the rest Sample.reasoning, as a parser would have returned them. A reply
without a closing tag stays whole: one that opens a block was cut off inside it (no action, an invalid one), and
one with no tag at all is the answer (the server's template is unknown here, so text without a tag is not
taken for reasoning cut off). The server's count of reasoning tokens (`completion_tokens_details`, where it
reports one; they are among the completion tokens) goes to the usage as `reasoning_tokens`.

Limits. A turn's token cap (--max-new-tokens) is the request's max_tokens (or max_completion_tokens, below),
counted by the server as a local engine counts its own. The trajectory's budget (--max-tokens) cannot be
counted here without the model's tokenizer, so the server's context window holds it: serve the model with
`--max-model-len` set to the budget. vLLM then caps a reply at what the window has left (a local engine caps
it at the budget's room, one token less, kept for an end-of-turn token) and refuses a prompt the window cannot
hold (HTTP 400, "maximum context length"); such a refusal (or another server's "prompt is too long") ends the
episode with finish "max_tokens", as a local episode that runs out of room ends, not as an error. So the two
agree except within a token or two of the budget. A hosted model's window is its own, and usually far above
the protocol's budget. The server's token counts (`usage`) are summed per episode with their cost
(--price-in / --price-out, dollars per million tokens).

Failures. Connection errors, timeouts (HTTP 408 too), HTTP 429 and 5xx are retried up to --api-retries
times after an exponential backoff with jitter (or the server's Retry-After, when longer); another 4xx is
not retried. A turn that still fails ends its own episode with finish "error" and the reason (scored 0,
counted under `errors`), never the eval. eval.py checks the server once before any episode (`check`), so
that a wrong URL or a refused key stops at once with one sentence.

Hosted reasoning models (OpenAI's o-series and GPT-5) refuse max_tokens, and any temperature or top_p but 1,
with an HTTP 400 that names the parameter ("Unsupported parameter: 'max_tokens' ...", "Unsupported value:
'temperature' does not support 0 ..."). The engine learns each such refusal once, for the rest of its life and
for every thread: max_tokens becomes max_completion_tokens with the same value, temperature and top_p are left
out (the server samples at its default, 1), and the refused turn is resent at once (counted as `adapted`, not as
a retry). Since that changes what is measured, `sampling` says the temperature and top_p the replies were
really sampled at, and eval.py records those and warns.

The API key comes from the environment ($OPENAI_API_KEY, or the variable --api-key-env names) and is sent as
a Bearer header, nowhere else: every message that leaves this module (errors, exceptions) is scrubbed of it.

Seeds. A sampled request carries a seed derived from --seed and the episode's task, group, row and turn, so
that a seeded server (vLLM) answers the same whatever order the requests arrive in; two episodes of one task
share seeds only when they also share a row, i.e. with --k above eval's --batch-size. Greedy requests
(temperature 0) carry none, even where the server refused the temperature and samples at 1. Hosted APIs treat
seeds as best effort.

Where this differs from upstream on purpose: AgentGym-RL's released code evaluates only local models (its
vLLM rollout); the paper's API models (GPT-4o, Gemini, DeepSeek-R1) were scored by a harness it does not
ship. Here they run through the very rollout loop and protocol limits the local models use, so the numbers
compare.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from rl.chat import Reasoning, parse_calls, reasoning_of, without_calls
from rl.engines import Sample

PREFIX = "openai:"  # --model openai:<name> names a served model
DEFAULT_URL = "https://api.openai.com/v1"


@dataclass
class APIArgs:
    """eval.py's flags for --model openai:<name> (nested in its Args under their own names)."""

    base_url: str | None = None
    """--model openai:<name>: the OpenAI-compatible endpoint; default $OPENAI_BASE_URL, else OpenAI's"""
    api_key_env: str = "OPENAI_API_KEY"
    """--model openai:<name>: the environment variable holding the API key (never written anywhere)"""
    api_concurrency: int = 8
    """--model openai:<name>: requests in flight at once"""
    api_retries: int = 4
    """--model openai:<name>: retries of a request after a connection error, a timeout, HTTP 429 or 5xx"""
    api_timeout: float = 120.0
    """--model openai:<name>: seconds a request may wait for the server before it counts as timed out"""
    api_backoff: float = 1.0
    """--model openai:<name>: seconds before the first retry, doubled for each next one (plus jitter)"""
    price_in: float = 0.0
    """--model openai:<name>: dollars per million prompt tokens, for the cost in the results"""
    price_out: float = 0.0
    """--model openai:<name>: dollars per million completion tokens"""

    def check(self, model: str) -> None:
        """Stop early, with what to do, on settings that cannot work for --model `model`."""
        if not model.startswith(PREFIX) and self.base_url is not None:
            raise SystemExit(f"--base-url is for --model {PREFIX}<name>: a model on a server, by the name it serves it "
                             "under")
        if self.api_concurrency < 1 or self.api_retries < 0 or self.api_timeout <= 0 or self.api_backoff < 0:
            raise SystemExit("need --api-concurrency >= 1, --api-retries >= 0, --api-timeout > 0 and --api-backoff >= 0")
# what an episode's calls cost: calls answered with a reply, the server's token counts (reasoning_tokens: those of
# the completion tokens the model reasoned with, where the server reports them), dollars
NO_USAGE = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0, "cost": 0.0}
MAX_WAIT = 120.0  # seconds: the longest pause before a retry, whatever Retry-After asks
# how servers word a request past the model's context window: OpenAI's and vLLM's "maximum context length",
# others' "prompt is too long" / "context_length_exceeded"
CONTEXT_FULL = re.compile(r"maximum context length|context[ _]length[ _]exceeded|prompt is too long", re.IGNORECASE)
# what a hosted reasoning model takes instead of a request parameter it refuses: the parameter's new name, or None
# to leave it out (the server then samples at its default, 1); OpenAI's refusals read "Unsupported parameter:
# 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead." and "Unsupported value:
# 'temperature' does not support 0 with this model. Only the default (1) value is supported."
ADAPTABLE = {"max_tokens": "max_completion_tokens", "temperature": None, "top_p": None}
UNSUPPORTED = re.compile(r"unsupported|not supported|does not support", re.IGNORECASE)


class APIFormat:
    """ChatFormat's part in a rollout for a text engine: the server templates the messages, so the first
    prompt and the observations add no tokens here. A reply's reasoning, when the server returns it inline in
    `content` (no reasoning parser), is read with the default <think> tags (rl/chat.py; APIEngine has already
    moved a closed block out of the reply), and tool calls the server leaves in `content` (no tool parser) are
    read as Hermes <tool_call> blocks."""

    opens_reasoning = False
    call_style = "hermes"

    def __init__(self, reasoning_tags: tuple[str, str] | None = None, template_kwargs: dict | None = None,
                 max_obs_tokens: int = 0):
        if max_obs_tokens:
            raise SystemExit("--max-obs-tokens counts an observation's tokens with the model's tokenizer, which a model "
                             "behind an API does not give: leave it out")
        self.reasoning = reasoning_of(None, reasoning_tags)
        self.template_kwargs = dict(template_kwargs or {})  # (the server's chat template options, sent with requests)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return []

    def observation(self, text: str, role: str = "user") -> list[int]:
        return []

    def cut(self, text: str) -> tuple[str, int]:
        return text, 0  # (no tokenizer to count with: --max-obs-tokens is refused for an API model)

    def text(self, sampled: list[int]) -> str:
        return ""  # (a text engine's replies come as Sample.text)

    def answer(self, reply: str) -> str | None:
        return self.reasoning.split(reply)[1]

    def parse_calls(self, answer: str) -> list[tuple[str, dict]]:
        return parse_calls(self.call_style, answer)


class APIEngine:
    """Chat completions from an OpenAI-compatible endpoint, up to `concurrency` requests in flight (a thread
    each). Continuous: a trajectory's next turn is sent as soon as its env answers and the rollout looks, which
    is at the next reply (`poll` waits for one); envs answer in milliseconds, API calls in seconds."""

    continuous = True
    name = "api"

    def __init__(self, base_url: str, model: str, *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                 concurrency: int = 8, retries: int = 4, timeout: float = 120.0, backoff: float = 1.0,
                 api_key_env: str = "OPENAI_API_KEY", price_in: float = 0.0, price_out: float = 0.0,
                 template_kwargs: dict | None = None, reasoning: Reasoning | None = None):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.reasoning = reasoning or reasoning_of(None)  # the tags of reasoning left inline (APIFormat's)
        self.template_kwargs = dict(template_kwargs or {})  # the server's chat template options (vLLM's chat_template_kwargs)
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.retries, self.timeout, self.backoff = retries, timeout, backoff
        self.prices = (price_in / 1e6, price_out / 1e6)  # dollars a prompt token, a completion token
        self._key = os.environ.get(api_key_env) or None
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="api")
        self._running: dict[Future, object] = {}
        self._closed = threading.Event()  # cuts retry pauses short at close()
        self._lock = threading.Lock()
        self.refused: set[str] = set()  # parameters of ADAPTABLE the server refused: adapted in every later request
        self.counts = {"requests": 0, "retries": 0, "adapted": 0, "failed_turns": 0}
        self.progress = 0

    # -- the engine contract

    @property
    def pending(self) -> int:
        return len(self._running)

    def submit(self, traj, limit: int) -> None:
        # (a reply's reasoning, kept with the episode as reasoning_content, and calls the rollout could not take, kept
        # as invalid_tool_calls, never go back to the server) and calls left inline by a server without a tool parser
        # go back once, as tool_calls
        messages = [{k: v for k, v in m.items() if k not in ("reasoning_content", "invalid_tool_calls")}
                    for m in traj.prompt_messages()]
        for message in messages:
            if message.get("tool_calls") and message.get("content"):
                message["content"] = without_calls(message["content"], "hermes")
        body = {"model": self.model, "messages": messages, "max_tokens": limit, "temperature": self.temperature,
                "top_p": self.top_p, **({"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {})}
        if self.temperature > 0:
            body["seed"] = zlib.crc32(f"{self.seed} {traj.task_id} {traj.group} {traj.row} {traj.turns}".encode())
        tools = getattr(traj, "tools", None)  # a tool-calling agent's function schemas; a text agent has none
        if tools:
            body["tools"] = tools
        self._running[self._pool.submit(self._turn, body)] = traj

    def poll(self) -> list[tuple[object, Sample]]:
        """The turns that have come back; waits for the first if none has."""
        if not self._running:
            return []
        done = wait(self._running, return_when=FIRST_COMPLETED).done
        self.progress += len(done)
        return [(self._running.pop(future), future.result()) for future in list(self._running) if future in done]

    def abort(self) -> None:
        """Forget every submitted turn (a rollout that stopped half-way); requests already sent run out unread."""
        for future in self._running:
            future.cancel()
        self._running.clear()

    def close(self) -> None:
        self._closed.set()
        self.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def metrics(self) -> dict[str, float]:
        """Requests sent, retries among them, resends adapted to a refused parameter (`adapted`) and turns that
        failed for good, since the last call."""
        with self._lock:
            counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts

    def check(self) -> str | None:
        """One GET {base_url}/models before any episode: raises ConnectionError with the reason if the server
        cannot be reached or refuses the key; returns a note if it answers but does not list the model."""
        try:
            listing = self._request("GET", "/models")
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                raise ConnectionError(self._scrub(f"{self.base_url} refused the API key: {_describe(error)}")) from None
            return None  # a server without the listing (404, ...): the chat requests will tell
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise ConnectionError(self._scrub(f"cannot reach {self.base_url}: {_describe(error)}")) from None
        entries = listing.get("data", []) if isinstance(listing, dict) else []
        served = [entry.get("id") for entry in entries if isinstance(entry, dict)]
        if served and self.model not in served:
            return f"{self.base_url} does not list {self.model!r} among its models ({', '.join(map(str, served[:8]))})"
        return None

    @property
    def sampling(self) -> dict[str, float]:
        """The temperature and top_p the replies were sampled at: the asked ones, or the server's default, 1, for
        one it refused."""
        with self._lock:
            return {name: 1.0 if name in self.refused else getattr(self, name) for name in ("temperature", "top_p")}

    # -- one turn: a request, retried

    def _turn(self, body: dict) -> Sample:
        """The reply to one request as a Sample: its text, tool calls, reasoning and usage; finish "max_tokens" for
        a full context window; the error, scrubbed of the key, once retries are spent or on a refusal. A refused
        parameter the engine can adapt (ADAPTABLE) is adapted and the request resent at once, which is no retry.
        What the server or the network does never raises here."""
        attempt = 0  # failed sends retried so far
        while True:
            sent = self._adapted(body)
            with self._lock:
                self.counts["requests"] += 1
            try:
                return self._sample(self._request("POST", "/chat/completions", sent))
            except urllib.error.HTTPError as error:
                reason, wait_s = _describe(error), _retry_after(error)
                if error.code == 400 and CONTEXT_FULL.search(reason):
                    return Sample([], usage=dict(NO_USAGE), finish="max_tokens")
                if error.code == 400 and self._learn(reason, sent):
                    continue
                if error.code not in (408, 429) and error.code < 500:  # (408: the server timed out waiting)
                    return self._failed(reason)
            except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError,
                    AttributeError, RecursionError) as error:
                # no answer (refused, reset, timed out), or one that is not a chat completion (or nests too deeply to read)
                reason, wait_s = _describe(error), None
            pause = max(wait_s or 0.0, self.backoff * 2 ** attempt * random.uniform(1.0, 1.5))
            if attempt == self.retries or self._closed.wait(min(pause, MAX_WAIT)):
                return self._failed(f"{reason} (after {attempt + 1} attempts)")
            attempt += 1
            with self._lock:
                self.counts["retries"] += 1

    def _adapted(self, body: dict) -> dict:
        """The request as this server takes it: each parameter it has refused renamed or left out (ADAPTABLE)."""
        with self._lock:
            refused = self.refused & body.keys()
        sent = {key: value for key, value in body.items() if key not in refused}
        sent |= {ADAPTABLE[name]: body[name] for name in refused if ADAPTABLE[name]}
        return sent

    def _learn(self, reason: str, sent: dict) -> bool:
        """Whether a 400's message refuses parameters of ADAPTABLE that `sent` carries; they are adapted from now
        on, in every request of every thread. (Each is learnt from a request that carried it, so a turn resends
        at most once a parameter.)"""
        named = {name for name in ADAPTABLE if name in sent and re.search(rf"\b{name}\b", reason)}
        if not named or not UNSUPPORTED.search(reason):
            return False
        with self._lock:
            self.refused |= named
            self.counts["adapted"] += 1
        return True

    def _failed(self, reason: str) -> Sample:
        with self._lock:
            self.counts["failed_turns"] += 1
        return Sample([], usage=dict(NO_USAGE), error=self._scrub(f"api: {reason}"))

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def _sample(self, reply: dict) -> Sample:
        usage = reply.get("usage") or {}
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        reasoning_tokens = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
        cost = prompt * self.prices[0] + completion * self.prices[1]
        message = reply["choices"][0]["message"]
        text = _as_text(message.get("content"))
        reasoning = message.get("reasoning_content") or message.get("reasoning")  # (vLLM and others name it so)
        if not reasoning:  # a server without a reasoning parser leaves it inline: the answer is after its last </think>
            inline, answer = self.reasoning.split(text)
            if answer is not None:  # (None: cut off inside it; the reply stays whole and the rollout answers it)
                reasoning, text = inline, answer
        return Sample([], text=text, tool_calls=_tool_calls(message),
                      reasoning=_as_text(reasoning) if reasoning else None,
                      usage={**NO_USAGE, "calls": 1, "prompt_tokens": prompt, "completion_tokens": completion,
                             "reasoning_tokens": reasoning_tokens, "cost": cost})

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text


def _tool_calls(message: dict) -> list[dict] | None:
    """A reply's tool calls as Sample carries them, {"id", "name", "arguments"} each, the arguments' JSON text
    exactly as the server sent it; whatever an entry lacks is "". A malformed entry is kept, never refused: the
    rollout validates the calls and answers a malformed one."""
    calls = message.get("tool_calls") or []
    calls = calls if isinstance(calls, list) else [calls]
    kept = []
    for call in calls:
        call = call if isinstance(call, dict) else {}
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        kept.append({"id": _as_text(call.get("id")), "name": _as_text(function.get("name")),
                     "arguments": _as_text(function.get("arguments"))})
    return kept or None


def _as_text(value) -> str:
    """A reply field as text: a string as it is, nothing as "", anything else (a server that sent JSON where the
    protocol has a string) as its JSON."""
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def _describe(error: Exception) -> str:
    """One line: the HTTP status and the server's own message, or the exception."""
    if isinstance(error, urllib.error.HTTPError):
        try:
            body = error.read().decode("utf-8", "replace")
        except OSError:
            body = ""
        try:
            detail = json.loads(body)
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            detail = detail.get("message", detail) if isinstance(detail, dict) else detail
        except ValueError:
            detail = body
        return f"HTTP {error.code} {error.reason}: {' '.join(str(detail).split())[:400]}"
    if isinstance(error, urllib.error.URLError):
        error = error.reason if isinstance(error.reason, Exception) else error
    return f"{type(error).__name__}: {error}"


def _retry_after(error: urllib.error.HTTPError) -> float | None:
    """The server's Retry-After, in seconds (it may be a number or an HTTP date)."""
    value = error.headers.get("Retry-After") if error.headers else None
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(email.utils.parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


def total_usage(trajectories) -> dict:
    """Calls, prompt, completion and reasoning tokens and cost summed over episodes (anything with a `usage`
    dict)."""
    total = dict(NO_USAGE)
    for traj in trajectories:
        for key, value in traj.usage.items():
            total[key] = total.get(key, 0) + value
    total["cost"] = round(total["cost"], 6)
    return total
