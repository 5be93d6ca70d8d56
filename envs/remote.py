"""An env on an AgentGym env server (ours, envs/serve.py, or AgentGym's own), behind the Env interface.

    env = envs.make("textcraft", url="http://127.0.0.1:36001")
    observation = env.reset(3)
    result = env.step(model_text)
    env.close()

It does what AgentGym's client for the env does (agentenv.envs.<env>): the ReAct parsing of TextCraft,
BabyAI and SciWorld, whose server gets only the action; the triple-backtick check of WebArena; and it
returns the reward that client returns (BabyAI and SciWorld: the server's cumulative `score`; WebArena:
the reward of a terminated step, else 0). The parsing and the instruction come from the env's own
module (envs/<env>.py), so over our own server a remote env gives exactly the observations, rewards
and done of the in-process one; that module must be importable here, its backend (JVM, browser, index)
need not be. An env AgentGym has no server for (one added to envs.ENVS) speaks envs/serve.py's own
endpoints: the raw text to /step, the env's StepResult back, info included.

Every request has a timeout (`timeout`, default envs.call_timeout(name)). A request that never reached
the server (connection refused, connect timeout) is tried again with exponential backoff, `retries`
times; so are /create, /reset, /observation and /close on a dropped connection or a 502/503 answer
(a reset starts the episode over, so repeating it is safe; a step is never repeated once sent). A reset
whose instance the server no longer has (closed, or idle past its --idle-timeout) starts on a new one.
Everything else raises RemoteEnvError with the server's reason; an unreachable server says so.

Options: timeout, retries, backoff (seconds before the first retry; doubled each time) and, for SciWorld,
reward ("score" as upstream, or "normalized": score / 100 with failure as 0, as envs/sciworld.py). The
env's own options (a SciWorld pool size, a SearchQA retriever) are the server's: `python -m envs.serve
--env-options ...`.

Where this differs from upstream's clients: the timeouts and retries above; SciWorld strips exactly a
trailing "</s>" (upstream's slice also eats the character before it, see envs/sciworld.py); SciWorld's
info["success"] is a completed task (score 100), where upstream has no such notion; a lone surrogate
in the model's text, which JSON cannot carry, is sent as "?"; an error answer raises RemoteEnvError
(upstream's clients fail on an assert or a KeyError); info["valid"] (did the env take the action) comes
from our server's answers, which carry it, and is absent over upstream's, which do not. So does state_key():
our server sends the env's with every /reset and /step answer, no extra request; over upstream's it is None.
"""

from __future__ import annotations

import re
import time

import httpx

from envs import REACT_ONLY_ONE, Env, StepResult, _module, call_timeout, react_action

RETRIED_STATUS = (502, 503)  # the env failed or the server is full: worth another try for idempotent calls
KEYED = ("/reset", "/step")  # the answers that carry the env's state key (our server's; upstream's have none)
STATE_KEY_HEADER = "State-Key"  # where an answer that is a bare string carries it (SearchQA's /reset)


class RemoteEnvError(RuntimeError):
    """The env server could not be reached or answered an error."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteEnv(Env):
    """Env `name` on the AgentGym server at `url`: one instance there, made now (POST /create)."""

    def __init__(self, name: str, url: str, timeout: float | None = None, retries: int = 4, backoff: float = 0.5,
                 reward: str = "score", **server_options):
        self.module = _module(name)  # its instruction and parsing; raises for an unknown env
        if server_options:
            raise ValueError(f"{', '.join(server_options)}: options of the {name} env itself, which runs on the "
                             f"server at {url}; give them to the server (python -m envs.serve --env-options ...)")
        if reward not in ("score", "normalized") or (reward != "score" and name != "sciworld"):
            raise ValueError(f"reward={reward!r}: only sciworld takes reward, \"score\" or \"normalized\"")
        self.name, self.url = name, url.rstrip("/")
        self.instruction, self.ack = self.module.INSTRUCTION, self.module.ACK
        self.timeout = call_timeout(name) if timeout is None else float(timeout)
        self.retries, self.backoff, self.reward_mode = int(retries), float(backoff), reward
        self.options = {"url": self.url, "timeout": self.timeout, "retries": self.retries, "reward": reward}
        self.id_field = "env_idx" if name in ("searchqa", "webarena") else "id"
        self.http = httpx.Client(base_url=self.url, timeout=self.timeout)
        self.key: str | None = None  # state_key(): from the last /reset or /step answer
        self.env_id = self._create()

    # -- the Env interface

    def reset(self, task_id: int) -> str:
        try:
            answer = self._post("/reset", self._reset_body(int(task_id)), idempotent=True)
        except RemoteEnvError as error:
            if error.status != 404:
                raise
            self.env_id = self._create()  # the server dropped our instance: start over on a new one
            answer = self._post("/reset", self._reset_body(int(task_id)), idempotent=True)
        return self._first_observation(answer, task_id)

    def step(self, text: str) -> StepResult:
        text = text.encode("utf-8", "replace").decode("utf-8")  # a lone surrogate cannot go in JSON: "?"
        if self.name in ("textcraft", "babyai"):
            action = react_action(text)
            if action is None:  # upstream's client answers this without asking the server
                return StepResult(REACT_ONLY_ONE, 0.0, False, {"action": None, "valid": False})
            answer = self._post("/step", {"action": action})
            reward = answer["score"] if self.name == "babyai" else answer["reward"]
            return StepResult(answer["observation"], float(reward), bool(answer["done"]), {"action": action, **valid(answer)})
        if self.name == "sciworld":
            return self._sciworld_step(self.module.parse_action(text))
        if self.name == "webarena" and not re.findall(r"```(.*?)```", text, re.DOTALL):
            return StepResult(self.module.NO_ACTION, 0.0, False, {"valid": False})
        answer = self._post("/step", {"action": text})
        if self.name == "searchqa":
            return StepResult(answer["observation"], float(answer["reward"]), bool(answer["done"]), valid(answer))
        if self.name == "webarena":
            done = bool(answer["terminated"])
            reward = float(answer["reward"]) if done else 0.0
            return StepResult(answer["observation"], reward, done, answer["info"] or {})
        return StepResult(answer["observation"], float(answer["reward"]), bool(answer["done"]), answer["info"])

    def state_key(self) -> str | None:
        """The state key our server sent with its last /reset or /step answer; None over upstream's servers."""
        return self.key

    def fork(self) -> Env:
        """Refused (Env.fork): AgentGym's server protocol has no call that copies an instance."""
        raise NotImplementedError(f"a {self.name} env on an env server ({self.url}) cannot copy its state: AgentGym's "
                                  "protocol has no call that copies an instance")

    def close(self) -> None:
        self.key = None
        try:  # best effort: a server that is gone drops the instance itself (idle expiry)
            self._post("/close", {}, idempotent=True, retries=0)
        except RemoteEnvError:
            pass
        self.http.close()

    # -- each env's shapes

    def _create(self):
        body = {"searchqa": {"id": 0}, "textcraft": {"commands": None, "goal": None}}.get(self.name)
        answer = self._request("POST", "/create", body, idempotent=True)
        return answer if self.name == "searchqa" else answer[self.id_field]

    def _reset_body(self, task_id: int) -> dict:
        if self.name == "searchqa":
            return {"id": task_id}
        if self.name == "webarena":
            return {"seed": 0, "idx": task_id}
        return {"data_idx": task_id}

    def _first_observation(self, answer, task_id: int) -> str:
        """What upstream's client.observe() gives right after its reset."""
        if self.name == "searchqa":
            return answer
        if self.name == "sciworld":
            return f"{answer['task_description']}\n{answer['observation']}"
        if self.name == "webarena":
            if answer["observation"] == "TimeoutError":  # upstream's server could not reset the browser
                raise RemoteEnvError(f"the webarena server at {self.url} could not reset task {task_id} (TimeoutError)")
            return self._request("GET", "/observation", params={"env_idx": self.env_id}, idempotent=True)
        return answer["observation"]

    def _sciworld_step(self, action: str) -> StepResult:
        answer = self._post("/step", {"action": action})
        score, done = answer["score"], bool(answer["done"])
        reward = max(score, 0) / 100 if self.reward_mode == "normalized" else float(score)
        return StepResult(answer["observation"], reward, done,
                          {"action": action, "score": score, "success": done and score >= 100, **valid(answer)})

    # -- HTTP

    def _post(self, path: str, body: dict, idempotent: bool = False, retries: int | None = None):
        return self._request("POST", path, {**body, self.id_field: self.env_id}, idempotent=idempotent,
                             retries=retries)

    def _request(self, method: str, path: str, body=None, params=None, idempotent: bool = False,
                 retries: int | None = None):
        retries = self.retries if retries is None else retries
        if path in KEYED:
            self.key = None  # until an answer says
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.http.request(method, path, json=body, params=params)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:  # never reached the server
                failure = RemoteEnvError(f"cannot reach the {self.name} env server at {self.url} "
                                         f"({type(error).__name__}: {error}); is `python -m envs.serve --env "
                                         f"{self.name}` (or AgentGym's server) running there?")
                continue
            except httpx.TimeoutException:
                raise RemoteEnvError(f"{method} {self.url}{path}: no answer within {self.timeout:g} s") from None
            except httpx.TransportError as error:
                failure = RemoteEnvError(f"{method} {self.url}{path}: {type(error).__name__}: {error}")
                if idempotent:
                    continue
                raise failure from None
            if response.status_code == 200:
                answer = self._answer(method, path, response)
                if path in KEYED:  # (a bare-string answer, SearchQA's /reset, has it in a header)
                    self.key = answer.get("state_key") if isinstance(answer, dict) else response.headers.get(STATE_KEY_HEADER)
                return answer
            failure = RemoteEnvError(f"{method} {self.url}{path} answered {response.status_code}: "
                                     f"{_reason(response)}", response.status_code)
            if not (idempotent and response.status_code in RETRIED_STATUS):
                raise failure
        raise failure

    def _answer(self, method: str, path: str, response: httpx.Response):
        try:
            answer = response.json()
        except ValueError:
            raise RemoteEnvError(f"{method} {self.url}{path} answered something that is not JSON: "
                                 f"{response.text[:200]!r}") from None
        if isinstance(answer, dict) and set(answer) == {"error"}:  # upstream's servers answer errors with 200
            raise RemoteEnvError(f"{method} {self.url}{path}: {answer['error']}")
        return answer


def _reason(response: httpx.Response) -> str:
    try:
        answer = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(answer, dict):
        return str(answer.get("error", answer.get("detail", answer)))[:500]
    return str(answer)[:500]


def valid(answer: dict) -> dict:
    """{"valid": ...} from a /step answer of our server (envs/serve.py adds it); {} from upstream's, which does
    not say (its invalid actions are then not counted)."""
    return {"valid": answer["valid"]} if isinstance(answer.get("valid"), bool) else {}
