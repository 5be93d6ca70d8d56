"""Serve one of our envs as an OpenEnv environment (openenv-core 0.3.0), so that OpenEnv's clients, and TRL's
OpenEnv integration through them, play it.

    python -m envs.standards.openenv_server --env babyai --port 8000
    python -m envs.standards.openenv_server --env webarena --env-options sites local --max-sessions 8

    from openenv.core.generic_client import GenericEnvClient
    with GenericEnvClient(base_url="http://127.0.0.1:8000").sync() as client:
        result = client.reset(task_id=12)                # or seed=3: the train split's task 3 (below)
        first = result.observation                       # {"text", "task_id", "instruction", "ack", "score", "info"}
        result = client.step({"text": "Thought: ...\nAction: turn left"})
        result.observation["text"], result.reward, result.done, result.observation["score"]   # (reward: the step's)

`AgentGymClient` below is the same client typed (TextAction in, TextObservation out).

What OpenEnv's server does with sessions (read from openenv-core 0.3.0's http_server.py): the WebSocket /ws, which
EnvClient and GenericEnvClient speak, gives each connection its own environment and a thread of its own for its
calls, closed when the connection closes. HTTP POST /reset and /step make a new environment for every request and
close it after, so an episode cannot be played over HTTP: /reset answers a first observation, /step answers 409
with a line that says to use the WebSocket. OpenEnv's observation serializer drops an Observation's `metadata` on
the wire, so what a client needs to build the prompt (the task id, our env's instruction and ack) are fields of
TextObservation; `metadata` holds the same in process.

reset(task_id=...) plays that task id (as envs.make(name).reset takes it); without one, reset(seed=s) plays the env's
train split's task s % len(split) (envs.splits: a seed a group's samples share gives them the same task), and a
reset with neither plays a random train task. A task id the env rejects (negative, or outside SearchQA's sets) is
an error on the client (RuntimeError "Server error: ...", HTTP /reset: 422 with the sentence), as is an env that fails (a dead JVM or browser): one line
each, and the session and the server go on. A malformed action (text that is no action) is an observation, as our
envs answer it; an action without a string `text` is the client's validation error.

reward is a step's reward, as OpenEnv's clients read it (TRL's examples and verifiers' OpenEnv taskset sum an
episode's rewards): the change in our env's StepResult.reward, which is the episode's outcome so far (AgentGym's: the
score, for BabyAI and SciWorld a running one); `score` carries that outcome itself, the return so far. So a client
that sums the rewards and one that reads the last score agree (a SciWorld episode's progress 25, 50, 100: rewards
25, 25, 50). info is the env's StepResult.info. Every session has its own env instance, so one server
holds up to --max-sessions sessions at once (SUPPORTS_CONCURRENT_SESSIONS: all five envs take several instances
in one process, as envs/serve.py serves them). A WebSocket client waits 60 s for an answer by default; SciWorld's
and WebArena's calls may take longer (envs.call_timeout): pass message_timeout_s=envs.call_timeout(name).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import uuid
from typing import Any

import uvicorn
from fastapi import Request, WebSocketDisconnect
from fastapi.responses import JSONResponse
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

import envs
from envs.serve import check_made, served_options

TASK_IDS = range(2**31)  # the task ids a reset may name (envs/serve.py's too); an env may refuse some of them


class TextAction(Action):
    text: str = Field(description="the model's reply, as our env's step takes it")


class TextObservation(Observation):
    text: str = Field(default="", description="the env's observation")
    task_id: int | None = Field(default=None, description="the task this episode plays")
    instruction: str = Field(default="", description="on reset: the env's instruction (the first user turn)")
    ack: str = Field(default="", description="on reset: the env's ack (the canned assistant reply after it)")
    score: float = Field(default=0.0, description="the episode's outcome so far (our env's reward; the return so far)")
    info: dict[str, Any] = Field(default_factory=dict, description="on a step: the env's StepResult.info")


class EpisodeState(State):
    env: str = ""
    task_id: int | None = None


class NoEpisode(RuntimeError):
    """A step without a reset before it on this environment (every HTTP /step: see the module docstring)."""


class AgentGymEnvironment(Environment[TextAction, TextObservation, EpisodeState]):
    """One session: our env `name` made with `options` on its first reset (OpenEnv also makes an environment for
    each /state and /metadata request and for each HTTP /reset and /step, which then cost nothing)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, name: str, options: dict | None = None):
        super().__init__()
        self.name, self.options = name, options or {}
        self.env: envs.Env | None = None
        self._state = EpisodeState(env=name)
        self.score = 0.0  # the episode's outcome so far: a step's reward is its change

    def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: int | None = None,
              **kwargs: Any) -> TextObservation:
        task_id = self.choose_task(seed, task_id)
        if self.env is None:
            self.env = envs.make(self.name, **self.options)
        text = self.env.reset(task_id)  # (a task the env rejects leaves the session's episode as it was)
        self._state = EpisodeState(env=self.name, episode_id=episode_id or str(uuid.uuid4()), task_id=task_id)
        self.score = 0.0
        opening = {"task_id": task_id, "instruction": self.env.instruction, "ack": self.env.ack}
        return TextObservation(text=text, **opening, done=False, reward=None, metadata={"env": self.name, **opening})

    def choose_task(self, seed: int | None, task_id: int | None) -> int:
        if task_id is not None:
            if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id not in TASK_IDS:
                raise ValueError(f"task_id must be an integer from 0 to {TASK_IDS.stop - 1}, not {task_id!r}")
            return task_id
        train = envs.splits(self.name)["train"]
        if seed is None:
            return random.choice(train)
        return train[int(seed) % len(train)]

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        if self.env is None or self._state.task_id is None:
            raise NoEpisode(f"this {self.name} environment has no episode: reset first. OpenEnv's HTTP /step makes a "
                            "new environment for every request, so play an episode over the WebSocket "
                            "(EnvClient, GenericEnvClient)")
        result = self.env.step(action.text)
        self._state.step_count += 1
        info = json.loads(json.dumps(result.info, default=str))  # (a value an env keeps as an object goes as its str)
        reward, self.score = result.reward - self.score, result.reward
        return TextObservation(text=result.observation, task_id=self._state.task_id, info=info, done=result.done,
                               reward=reward, score=result.reward,
                               metadata={"env": self.name, "task_id": self._state.task_id})

    @property
    def state(self) -> EpisodeState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name=f"agentgym-rl {self.name}", version="1.0.0",
                                   description=f"AgentGym's {self.name} environment, in process (envs/{self.name}); "
                                               "the action is the model's reply text")

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


class AgentGymClient(EnvClient[TextAction, TextObservation, EpisodeState]):
    """OpenEnv's WebSocket client, typed: step(TextAction(text=...)) -> StepResult[TextObservation]."""

    def _step_payload(self, action: TextAction) -> dict:
        return {"text": action.text}

    def _parse_result(self, payload: dict) -> StepResult[TextObservation]:
        observation = TextObservation(**payload.get("observation", {}), done=payload.get("done", False),
                                      reward=payload.get("reward"))
        return StepResult(observation=observation, reward=observation.reward, done=observation.done)

    def _parse_state(self, payload: dict) -> EpisodeState:
        return EpisodeState(**payload)


# ----------------------------------------------------------------------------------------------
# The app and the command line


def build_app(name: str, options: dict | None = None, max_sessions: int = 64):
    """OpenEnv's app (create_app) for our env `name`, holding up to `max_sessions` WebSocket sessions at once."""
    envs.registration(name)  # (an unknown name stops here, with the names there are)
    app = create_app(functools.partial(AgentGymEnvironment, name, options or {}), TextAction, TextObservation,
                     env_name=name, max_concurrent_envs=max_sessions)

    @app.exception_handler(NoEpisode)
    async def no_episode(request: Request, error: NoEpisode):
        return JSONResponse({"detail": str(error)}, status_code=409)

    @app.exception_handler(ValueError)
    async def rejected(request: Request, error: ValueError):  # (a task id the server or the env rejects: HTTP /reset)
        return JSONResponse({"detail": str(error)}, status_code=422)

    app.add_middleware(QuietClose)
    return app


class QuietClose:
    """ASGI middleware: OpenEnv 0.3.0's /ws closes a socket that its client already closed, on which starlette raises
    WebSocketDisconnect, and uvicorn would log a traceback at the end of every session; the session is over either
    way, so it ends quietly."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except WebSocketDisconnect:
            if scope["type"] != "websocket":
                raise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m envs.standards.openenv_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, choices=envs.ENVS, help="which env to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (OpenEnv's examples use 8000)")
    parser.add_argument("--env-options", nargs="*", default=[], metavar="KEY VALUE",
                        help="keyword options for envs.make, as train.py's, e.g. sites local")
    parser.add_argument("--max-sessions", type=int, default=64, help="most WebSocket sessions (env instances) at once")
    args = parser.parse_args(argv)
    args.env_options = served_options(parser, args.env_options)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_made("openenv_server", args.env, args.env_options)
    app = build_app(args.env, args.env_options, args.max_sessions)
    print(f"serving {args.env} on http://{args.host}:{args.port} (OpenEnv: WebSocket /ws, /reset, /step, /schema)",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
