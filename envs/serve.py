"""Serve one of our envs over AgentGym's HTTP protocol, so that AgentGym's own clients can use it.

    python -m envs.serve --env textcraft --port 36001
    python -m envs.serve --env sciworld --port 36001 --env-options pool_size 32 --max-envs 256
    python -m envs.serve --env babyai --host 0.0.0.0 --port 36001     # reachable from other machines

Endpoints, request bodies and answers are those of AgentGym's servers (agentenv-<env>), so that its
clients (agentenv's TextCraftEnvClient, BabyAIEnvClient, SciworldEnvClient, SearchQAEnvClient,
WebarenaEnvClient) and AgentGym-RL's rollout work unchanged; envs/remote.py is our own client.
An instance is named by "id" (TextCraft, BabyAI, SciWorld) or "env_idx" (SearchQA, WebArena), in the
JSON body of a POST and the query string of a GET:

    all        GET /  (a greeting); POST /create, /reset, /step, /close; GET /observation
    textcraft  /create {commands?, goal?} -> {id, observation, done, reward}, reset to task id = id as upstream
               /reset {id, data_idx} -> {id, observation, done, reward}; /step {id, action} -> {observation,
               reward, done}; GET /observation -> str; GET /detail -> {observation, reward, done, deleted}
    babyai     /create -> {id}; /reset {id, data_idx} -> {observation, reward, score, deleted, done};
               /step {id, action} -> {observation, reward, score, done} (reward: this step's, score: the sum);
               GET /observation -> {observation, reward, score, done, deleted}; POST /render {id} -> PNG data URL
    sciworld   /create -> {id}; /reset {id, data_idx} -> {task_name, var_num, task_description, observation,
               reward, score, deleted, done}; /step {id, action} -> {observation, reward, score, done};
               GET /observation -> str, /action_hint -> {possible_actions, possible_objects}, /goals, /detail
    searchqa   /create {id} -> env_idx (a bare int); /reset {env_idx, id} -> the observation (str);
               /step {env_idx, action} -> {observation, reward, done, info: null}; GET /observation -> str
    webarena   /create -> {env_idx}; /reset {env_idx, seed, idx} -> {observation, sites, object};
               /step {env_idx, action} -> {observation, reward, terminated, truncated, info};
               GET /observation -> str; GET /list_envs -> [env_idx, ...]; /close -> {closed}
    others     an env AgentGym has no server for (one added to envs.ENVS) has endpoints of ours: /create -> {id};
               /reset {id, data_idx} -> {observation}; /step {id, action} -> {observation, reward, done, info}
               (the model's raw text in, the env's StepResult out; its info must be JSON); GET /observation
               -> str, /detail -> the last answer

AgentGym's TextCraft, BabyAI and SciWorld clients parse the model's ReAct text themselves and POST only
the action, which the server applies as upstream's does (the env's `act`); the SearchQA and WebArena
clients POST the model's raw text, which goes to the env's `step`.

Safety: binds 127.0.0.1 unless --host says otherwise; a body over --max-body-bytes is refused (413);
at most --max-envs instances live at once (a /create beyond that is a 503, after idle ones are
expired); an instance not called for --idle-timeout seconds is closed; env calls run in a thread pool
of --workers threads, one call at a time per instance, each given --call-timeout seconds (default
envs.call_timeout(env)): a call past it answers 504 and its instance is dropped (and closed once the
call returns; its thread cannot be stopped before that).

Where this differs from upstream on purpose:
- Errors are HTTP errors whose JSON body is one line, {"error": reason}: 400 bad JSON, 404 unknown id
  (never created, closed, expired or dropped), 409 a step before the first reset, 413 too big, 422 a
  missing or ill-typed field or a task id the env rejects, 502 the env failed (a dead JVM or browser),
  503 at the instance cap or the instance busy, 504 the call timed out. Upstream answers most errors
  with HTTP 200 {"error": ...}, on which its clients fail with a KeyError; they assert status 200, so
  they fail here too, with the reason in the body. Two answers keep upstream's shape because callers
  rely on them: /close of an unknown id answers 200 false (WebArena: {"closed": "closed"}), as upstream
  does, since AgentGym-RL closes every client after a rollout; and a WebArena /reset whose env fails or
  times out answers 200 {"observation": "TimeoutError", "sites": "Error", "object": "Error"}, which
  upstream's client turns into the TimeoutError that AgentGym-RL's rollout catches.
- Episodes are our ports' (envs/<env>.py lists how they differ), e.g. a step after the end answers
  "The task is already finished." where upstream's server errs.
- A /step answer also says whether the env took the action: `valid` (WebArena: in its `info`, as the port
  reports it), which upstream's clients ignore and envs/remote.py passes on, so that a run over a server
  counts invalid actions as one in process does.
- Every /reset and /step answer (and TextCraft's /create, which resets) also carries `state_key`, the env's
  Env.state_key() read in the same call (GiGPO's anchor groups), which upstream's clients ignore and
  envs/remote.py keeps. SearchQA's /reset answer is a bare string, so there it is the `State-Key` header.
- TextCraft's /create refuses custom `commands`/`goal` (422; our port has none) and SearchQA's ignores
  the item id that upstream preloads (here GET /observation before the first /reset is a 409).
  WebArena's `seed` is accepted and unused.
- The WebArena server gets the model's raw text from upstream's client, which answers text without
  triple backticks itself; if another client sends such text, it gets that same answer here, where
  upstream's server answered "Cannot parse action from response <the text>".
- Not served: the visualization extras (SciWorld /step_visual, /task_description, /object_tree, /state;
  WebArena /observation_metadata; CORS for VISUAL=true) and TextCraft's /commands and /goal, which
  upstream declares but never implemented. AgentGym's README names /createEnv and /available_actions,
  which none of its servers has either (BabyAI's available actions end every observation, as upstream).
  Env options are the server's --env-options.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, Field
from starlette.exceptions import HTTPException

import envs
from envs.remote import STATE_KEY_HEADER

TaskId = Annotated[int, Field(ge=0, lt=2**31)]  # a task id in a body (data_idx, id, idx)


def unicode_text(text: str) -> str:
    try:  # JSON can carry lone surrogates ("\ud800"), which no env, JVM or browser can take
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be Unicode text (it has a lone surrogate)") from None
    return text


Action = Annotated[str, AfterValidator(unicode_text)]


class Refused(Exception):
    """A request answered with an HTTP error: `status` and a one-line `reason`."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:500] if text else ''}"


# ----------------------------------------------------------------------------------------------
# Live env instances and the thread pool their calls run in


@dataclass
class Instance:
    id: int
    env: envs.Env
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one env call at a time
    used: float = field(default_factory=time.monotonic)
    ready: bool = False  # a reset succeeded: steps may follow
    observation: str = ""  # what GET /observation answers (per env, as upstream)
    detail: dict = field(default_factory=dict)  # upstream's per-instance info: the last answer's fields


class Instances:
    """The live instances of one env, by id, and the threads their calls run in. Only the event loop's
    thread touches this table, so it needs no lock; each instance's asyncio lock serializes its calls."""

    def __init__(self, name: str, options: dict, max_envs: int, idle_timeout: float, call_timeout: float,
                 workers: int):
        self.name, self.options = name, options
        self.max_envs, self.idle_timeout, self.call_timeout = max_envs, idle_timeout, call_timeout
        self.live: dict[int, Instance] = {}
        self.next_id = 0
        self.creating = 0  # /create calls whose env is being made: their slots are taken
        self.threads = ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-env")

    def get(self, id: int) -> Instance:
        if id not in self.live:
            raise self.unknown(id)
        return self.live[id]

    def unknown(self, id: int) -> Refused:
        return Refused(404, f"no {self.name} env with id {id}: never created, closed, idle for more than "
                            f"{self.idle_timeout:g} s, or dropped after a call timed out")

    async def create(self) -> Instance:
        if len(self.live) + self.creating >= self.max_envs:
            self.expire()
        if len(self.live) + self.creating >= self.max_envs:
            raise Refused(503, f"the server holds its maximum of {self.max_envs} env instances; close some, "
                               f"or wait for idle ones to expire ({self.idle_timeout:g} s)")
        self.creating += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(self.threads, lambda: envs.make(self.name, **self.options))
            try:
                env = await asyncio.wait_for(asyncio.shield(future), self.call_timeout)
            except asyncio.TimeoutError:
                future.add_done_callback(self._made_late)
                raise Refused(504, f"making a {self.name} env took longer than {self.call_timeout:g} s") from None
            except Exception as error:
                raise Refused(502, f"making a {self.name} env failed: {one_line(error)}") from None
        finally:
            self.creating -= 1
        instance = Instance(self.next_id, env)
        self.live[instance.id] = instance
        self.next_id += 1
        return instance

    def _made_late(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.dispose(future.result())

    async def call(self, instance: Instance, fn: Callable[[envs.Env], object], what: str, needs_episode: bool = True):
        """fn(instance.env) in the thread pool, alone on its instance, within the call timeout."""
        if needs_episode and not instance.ready:
            raise Refused(409, f"env {instance.id} has no episode: POST /reset first")
        try:
            await asyncio.wait_for(instance.lock.acquire(), self.call_timeout)
        except asyncio.TimeoutError:
            raise Refused(503, f"env {instance.id} stayed busy with another call for {self.call_timeout:g} s") from None
        if self.live.get(instance.id) is not instance:  # closed while this call waited
            instance.lock.release()
            raise self.unknown(instance.id)
        future = asyncio.get_running_loop().run_in_executor(self.threads, fn, instance.env)
        future.add_done_callback(lambda _: self._finished(instance))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.call_timeout)
        except asyncio.TimeoutError:
            self.live.pop(instance.id, None)  # closed by _finished, when (if ever) the call returns
            raise Refused(504, f"{what} took longer than {self.call_timeout:g} s; env {instance.id} was dropped, "
                               "create a new one") from None
        except Exception as error:  # a ValueError is the env refusing its input (a task id out of range)
            raise Refused(422 if isinstance(error, ValueError) else 502, f"{what} failed: {one_line(error)}") from None
        finally:
            instance.used = time.monotonic()

    def _finished(self, instance: Instance) -> None:
        instance.lock.release()
        if self.live.get(instance.id) is not instance:
            self.dispose(instance.env)

    def dispose(self, env: envs.Env):
        """Close an env in the background (a close may be slow or hang; it never fails a request)."""
        return self.threads.submit(close_quietly, env)

    async def close(self, id: int) -> bool:
        instance = self.live.pop(id, None)
        if instance is None:
            return False
        if not instance.lock.locked():  # else the running call's _finished closes it
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(self.dispose(instance.env)), self.call_timeout)
        return True

    def expire(self) -> None:
        now = time.monotonic()
        for instance in list(self.live.values()):
            if now - instance.used > self.idle_timeout and not instance.lock.locked():
                del self.live[instance.id]
                self.dispose(instance.env)

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.idle_timeout / 4, 0.05), 30))
            self.expire()

    def shutdown(self) -> None:
        for instance in list(self.live.values()):
            self.dispose(instance.env)
        self.live.clear()
        self.threads.shutdown(wait=False, cancel_futures=False)

    async def reset(self, instance: Instance, fn: Callable[[envs.Env], object]) -> tuple[object, str | None]:
        """fn(env) as a reset: its answer, and the env's state key after it (read in the same call)."""
        instance.ready = False
        answer = await self.call(instance, lambda env: (fn(env), envs.state_key_of(env)), "reset", needs_episode=False)
        instance.ready = True
        return answer

    async def step(self, instance: Instance, fn: Callable[[envs.Env], envs.StepResult]) -> tuple[envs.StepResult, str | None]:
        """fn(env) as a step: its result, and the env's state key after it (read in the same call)."""
        return await self.call(instance, lambda env: (fn(env), envs.state_key_of(env)), "step")


def close_quietly(env: envs.Env) -> None:
    with contextlib.suppress(Exception):
        env.close()


# ----------------------------------------------------------------------------------------------
# Request bodies (extra fields are ignored, as upstream's pydantic models do)


class IdBody(BaseModel):
    id: int


class IdStep(BaseModel):
    id: int
    action: Action


class IdReset(BaseModel):
    id: int
    data_idx: TaskId


class EnvIdxBody(BaseModel):
    env_idx: int


class EnvIdxStep(BaseModel):
    env_idx: int
    action: Action


class TextCraftCreate(BaseModel):
    commands: str | None = None
    goal: str | None = None


class TextCraftReset(BaseModel):
    id: int
    data_idx: TaskId = 0


class SearchQACreate(BaseModel):
    id: int = 0  # the item upstream preloads; unused here


class SearchQAReset(BaseModel):
    env_idx: int
    id: TaskId


class WebArenaReset(BaseModel):
    env_idx: int
    seed: int = 0
    idx: TaskId


# ----------------------------------------------------------------------------------------------
# Each env's endpoints


def textcraft_routes(app: FastAPI, pool: Instances) -> None:
    from envs import textcraft

    @app.get("/")
    async def hello():
        return "This is environment TextCraft."

    async def reset(instance: Instance, data_idx: int) -> dict:
        observation, key = await pool.reset(instance, lambda env: env.reset(data_idx))
        answer = {"id": instance.id, "observation": observation, "done": False, "reward": 0}
        instance.observation, instance.detail = observation, {"observation": observation, "done": False,
                                                              "reward": 0, "deleted": False}
        return {**answer, "state_key": key}

    @app.post("/create")
    async def create(body: TextCraftCreate | None = None):
        if body is not None and (body.commands or body.goal):
            raise Refused(422, "custom commands and goal are not supported here; /create without them, then "
                               "/reset to a task id")
        instance = await pool.create()
        try:
            # (upstream resets a new env to task id = env id, whose goal is goals[id % 544]: here ids from 544 on are
            # renamed goals, envs/textcraft.py, so a long-lived server's 545th env gets upstream's goal by the modulo)
            return await reset(instance, instance.id % len(textcraft.crafting_tree().goals))
        except Refused:
            await pool.close(instance.id)
            raise

    @app.post("/reset")
    async def reset_endpoint(body: TextCraftReset):
        return await reset(pool.get(body.id), body.data_idx)

    @app.post("/step")
    async def step(body: IdStep):
        instance = pool.get(body.id)
        result, key = await pool.step(instance, lambda env: env.act(body.action))
        answer = {"observation": result.observation, "reward": result.reward, "done": result.done}
        instance.observation = result.observation
        instance.detail.update(answer)
        return {**answer, "valid": result.info.get("valid"), "state_key": key}

    id_observation_routes(app, pool)
    id_close_route(app, pool)


def babyai_routes(app: FastAPI, pool: Instances) -> None:
    @app.get("/")
    async def hello():
        return "This is environment BabyAI."

    @app.post("/create")
    async def create():
        return {"id": (await pool.create()).id}

    @app.post("/reset")
    async def reset(body: IdReset):
        instance = pool.get(body.id)
        (observation, goal), key = await pool.reset(instance, lambda env: (env.reset(body.data_idx), env.goal))
        answer = {"observation": observation, "reward": 0.0, "score": 0.0, "deleted": False, "done": False}
        instance.observation, instance.detail = observation, {**answer, "goal": goal}
        return {**answer, "state_key": key}

    @app.post("/step")
    async def step(body: IdStep):
        instance = pool.get(body.id)
        result, key = await pool.step(instance, lambda env: env.act(body.action))
        # our StepResult's reward is upstream's cumulative score; upstream's "reward" is this step's part of it
        answer = {"observation": result.observation, "reward": result.reward - instance.detail["score"],
                  "score": result.reward, "done": result.done}
        instance.observation = f"Your goal: {instance.detail['goal']}\n{result.observation}"
        instance.detail.update(answer)
        return {**answer, "valid": result.info.get("valid"), "state_key": key}

    @app.get("/observation")
    async def observation(id: int):
        instance = pool.get(id)
        if not instance.ready:
            raise Refused(409, f"env {id} has no episode: POST /reset first")
        detail = instance.detail
        return {"observation": instance.observation, "reward": detail["reward"], "score": detail["score"],
                "done": detail["done"], "deleted": False}

    @app.post("/render")
    async def render(body: IdBody):
        instance = pool.get(body.id)
        from envs.babyai import picture

        image = await pool.call(instance, picture, "render")
        return "data:image/png;base64," + base64.b64encode(image).decode()

    id_close_route(app, pool)


def sciworld_routes(app: FastAPI, pool: Instances) -> None:
    @app.get("/")
    async def hello():
        return "This is environment ScienceWorld."

    @app.post("/create")
    async def create():
        return {"id": (await pool.create()).id}

    def reset_and_describe(env, task_id: int):
        observation = env.reset(task_id)
        return observation, env.task, env.variation, env.call(lambda sim: sim.getTaskDescription())

    @app.post("/reset")
    async def reset(body: IdReset):
        instance = pool.get(body.id)
        (observation, task, variation, description), key = await pool.reset(
            instance, lambda env: reset_and_describe(env, body.data_idx))
        look = observation[len(description) + 1:]  # our reset answers the description, "\n", then "look around"
        answer = {"task_name": task, "var_num": variation, "task_description": description, "observation": look,
                  "reward": 0, "score": 0, "deleted": False, "done": False}
        instance.observation, instance.detail = look, dict(answer)
        return {**answer, "state_key": key}

    @app.post("/step")
    async def step(body: IdStep):
        instance = pool.get(body.id)
        result, key = await pool.step(instance, lambda env: env.act(body.action))
        score = result.info["score"]  # upstream's score whatever our reward option: its client decides
        answer = {"observation": result.observation, "reward": score - instance.detail["score"], "score": score,
                  "done": result.done}
        instance.observation = result.observation
        instance.detail.update(answer)
        return {**answer, "valid": result.info.get("valid"), "state_key": key}

    id_observation_routes(app, pool)
    def hints(env) -> dict:
        return env.call(lambda sim: {"possible_actions": list(sim.getPossibleActions()),
                                     "possible_objects": list(sim.getPossibleObjects())})

    @app.get("/action_hint")
    async def action_hint(id: int):
        return await pool.call(pool.get(id), hints, "action_hint")

    @app.get("/goals")
    async def goals(id: int):
        progress = await pool.call(pool.get(id), lambda env: env.call(lambda sim: sim.getGoalProgressStr()), "goals")
        return {"goals": progress}

    id_close_route(app, pool)


def searchqa_routes(app: FastAPI, pool: Instances) -> None:
    @app.get("/")
    async def hello():
        return "ok"

    @app.post("/create")
    async def create(body: SearchQACreate | None = None):
        return (await pool.create()).id

    @app.post("/reset")
    async def reset(body: SearchQAReset):
        instance = pool.get(body.env_idx)
        instance.observation, key = await pool.reset(instance, lambda env: env.reset(body.id))
        # a bare string, as upstream's client reads it: the key goes in a header
        return JSONResponse(instance.observation, headers={} if key is None else {STATE_KEY_HEADER: key})

    @app.post("/step")
    async def step(body: EnvIdxStep):
        result, key = await pool.step(pool.get(body.env_idx), lambda env: env.step(body.action))
        return {"observation": result.observation, "reward": result.reward, "done": result.done, "info": None,
                "valid": result.info.get("valid"), "state_key": key}

    @app.get("/observation")
    async def observation(env_idx: int):
        instance = pool.get(env_idx)
        if not instance.ready:
            raise Refused(409, f"env {env_idx} has no question: POST /reset first")
        return instance.observation  # upstream's is always the question prompt

    @app.post("/close")
    async def close(body: EnvIdxBody):
        return await pool.close(body.env_idx)


def webarena_routes(app: FastAPI, pool: Instances) -> None:
    @app.get("/")
    async def hello():
        return "ok"

    @app.get("/list_envs")
    async def list_envs():
        return list(pool.live)

    @app.post("/create")
    async def create():
        return {"env_idx": (await pool.create()).id}

    def reset_and_read(env, task_id: int):
        return env.reset(task_id), env.tree, env.config["sites"], env.config["intent"]

    @app.post("/reset")
    async def reset(body: WebArenaReset):
        instance = pool.get(body.env_idx)
        try:
            (prompt, tree, sites, intent), key = await pool.reset(instance, lambda env: reset_and_read(env, body.idx))
        except Refused as refused:
            if refused.status not in (502, 504):
                raise
            # upstream's answer, which its client turns into the TimeoutError AgentGym-RL's rollout catches
            return {"observation": "TimeoutError", "sites": "Error", "object": "Error"}
        instance.observation = prompt
        return {"observation": tree, "sites": sites, "object": intent, "state_key": key}

    @app.post("/step")
    async def step(body: EnvIdxStep):
        instance = pool.get(body.env_idx)
        result, key = await pool.step(instance, lambda env: env.step(body.action))
        if result.info.get("valid"):  # a step the browser took: the prompt moved on (else upstream's stays)
            instance.observation = result.observation
        return {"observation": result.observation, "reward": result.reward, "terminated": result.done,
                "truncated": False, "info": result.info, "state_key": key}

    @app.get("/observation")
    async def observation(env_idx: int):
        instance = pool.get(env_idx)
        if not instance.ready:
            raise Refused(409, f"env {env_idx} has no task: POST /reset first")
        return instance.observation

    @app.post("/close")
    async def close(body: EnvIdxBody):
        await pool.close(body.env_idx)
        return {"closed": "closed"}


def own_routes(app: FastAPI, pool: Instances) -> None:
    """An env AgentGym has no server for (one added to envs.ENVS): TextCraft's and BabyAI's ids, the model's raw
    text to the env's `step`, and its StepResult as it is, which envs/remote.py reads back."""
    @app.get("/")
    async def hello():
        return f"This is environment {pool.name}."

    @app.post("/create")
    async def create():
        return {"id": (await pool.create()).id}

    @app.post("/reset")
    async def reset(body: IdReset):
        instance = pool.get(body.id)
        instance.observation, key = await pool.reset(instance, lambda env: env.reset(body.data_idx))
        instance.detail = {"observation": instance.observation, "reward": 0.0, "done": False, "info": {},
                           "state_key": key}
        return {"observation": instance.observation, "state_key": key}

    @app.post("/step")
    async def step(body: IdStep):
        instance = pool.get(body.id)
        result, key = await pool.step(instance, lambda env: env.step(body.action))
        instance.observation = result.observation
        instance.detail = {"observation": result.observation, "reward": result.reward, "done": result.done,
                           "info": result.info, "state_key": key}
        return instance.detail

    id_observation_routes(app, pool)
    id_close_route(app, pool)


def id_observation_routes(app: FastAPI, pool: Instances) -> None:
    """GET /observation (the last observation) and /detail (the last answer) of TextCraft, SciWorld and our own."""
    @app.get("/observation")
    async def observation(id: int):
        return pool.get(id).observation

    @app.get("/detail")
    async def detail(id: int):
        return pool.get(id).detail


def id_close_route(app: FastAPI, pool: Instances) -> None:
    @app.post("/close")
    async def close(body: IdBody):
        return await pool.close(body.id)


ROUTES = {"textcraft": textcraft_routes, "babyai": babyai_routes, "sciworld": sciworld_routes,
          "searchqa": searchqa_routes, "webarena": webarena_routes}  # AgentGym's servers; any other env: own_routes


# ----------------------------------------------------------------------------------------------
# The app: errors as one line of JSON, a body size limit


def refuse(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


def validation_reason(error: RequestValidationError) -> tuple[int, str]:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return 400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'cannot parse')})"
    where = ".".join(str(part) for part in first["loc"])
    if first["loc"] == ("body",):
        return 422, f"a JSON object body is needed: {first['msg']}"
    return 422, f"{where}: {first['msg']}"


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes, by its Content-Length or as it streams."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            status = 413 if length.isdigit() else 400
            return await refuse(status, f"the body must be at most {self.limit} bytes")(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, f"the body must be at most {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def build_app(name: str, options: dict | None = None, max_envs: int = 512, idle_timeout: float = 1800.0,
              call_timeout: float | None = None, max_body_bytes: int = 1 << 20, workers: int = 64) -> FastAPI:
    """The server for env `name` (see the module docstring; the arguments are main()'s flags)."""
    pool = Instances(name, options or {}, max_envs, idle_timeout,
                     envs.call_timeout(name) if call_timeout is None else call_timeout, workers)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        expiry = asyncio.create_task(pool.expire_forever())
        yield
        expiry.cancel()
        pool.shutdown()

    app = FastAPI(title=f"AgentGym {name} env server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.instances = pool
    ROUTES.get(name, own_routes)(app, pool)

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused):
        return refuse(error.status, error.reason)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return refuse(*validation_reason(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return refuse(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):  # a bug of ours: one line, never a traceback
        return refuse(500, f"internal error: {one_line(error)}")

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    return app


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m envs.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, choices=envs.ENVS, help="which env to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (AgentGym's READMEs use 36001)")
    parser.add_argument("--env-options", nargs="*", default=[], metavar="KEY VALUE",
                        help="keyword options for envs.make, as train.py's, e.g. pool_size 32")
    parser.add_argument("--max-envs", type=int, default=512, help="most env instances alive at once")
    parser.add_argument("--idle-timeout", type=float, default=1800.0,
                        help="seconds after its last call that an instance is closed")
    parser.add_argument("--call-timeout", type=float, default=None,
                        help="seconds an env call may take (default: envs.call_timeout(env))")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    parser.add_argument("--workers", type=int, default=64, help="threads that run env calls")
    args = parser.parse_args(argv)
    args.env_options = served_options(parser, args.env_options)
    return args


def served_options(parser: argparse.ArgumentParser, options: list[str]) -> dict:
    """A server's --env-options KEY VALUE ... as Python values (envs.parse_options); unpaired, the parser's error."""
    if len(options) % 2:
        parser.error("--env-options takes KEY VALUE pairs")
    return envs.parse_options(dict(zip(options[::2], options[1::2])))


def check_made(prog: str, name: str, options: dict) -> None:
    """Make and close one env as the server will: bad options stop it here, before its port opens."""
    try:
        envs.make(name, **options).close()
    except Exception as error:  # noqa: BLE001 - whatever the env raises, the server says it in one line
        sys.exit(f"{prog}: cannot make a {name} env with options {options}: {one_line(error)}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_made("envs.serve", args.env, args.env_options)
    app = build_app(args.env, args.env_options, args.max_envs, args.idle_timeout, args.call_timeout,
                    args.max_body_bytes, args.workers)
    print(f"serving {args.env} on http://{args.host}:{args.port} (AgentGym's protocol)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=75)


if __name__ == "__main__":
    main()
