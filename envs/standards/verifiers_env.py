"""Our envs as a verifiers environment (verifiers 0.4.0, the `verifiers.v1` stack that prime-rl runs), so that
verifiers' own rollout machinery plays them.

    from envs.standards.verifiers_env import load_environment
    env = load_environment("babyai", split="test", num_tasks=8)         # a vf.Env; options go to envs.make

    import envs.standards.verifiers_env                                 # registers the id agentgym-rl
    import verifiers.v1 as vf
    env = vf.load_environment(vf.resolve_env_config(
        {"taskset": {"id": "agentgym-rl", "env": "babyai", "split": "test", "num_tasks": 8}}))

    python -m envs.standards.verifiers_env agentgym-rl --env.taskset.env babyai -n 8 \
        --model Qwen/Qwen2.5-7B-Instruct --client.base-url http://127.0.0.1:8000/v1      # verifiers' eval CLI

What verifiers 0.4.0 is (read from its installed source): there is no MultiTurnEnv or rubric any more. An
environment is a Taskset (its rows: typed tasks with a prompt), an Env whose `run(task, agents)` plays one episode by
driving the model's "interaction" turn by turn (the caller is the model's user: here our env), and a Harness, the
program that makes the model calls, each through verifiers' interception server, which records the trace and
forwards to the model's endpoint. Rewards are recorded on the trace. This module is that shape, after verifiers'
own TextArena taskset (a game engine playing the user):

- AgentGymTaskset: a row per task id (the split's first `num_tasks`, or `task_ids`); its prompt is our env's opening
  as rl/agent.py's react format lays it out: the instruction (user), the ack (assistant), the first observation
  (user). Building a row resets an env to the task, so rows are made as they are read.
- AgentGymEnv.run: one env per episode (envs.make, in a thread: our envs block), reset to the task; the model's
  reply goes to env.step as it is (the assistant message's text), the observation comes back as the next user turn,
  until our env's done or `horizon` steps (default: the env's upstream horizon, envs.ENVS); the env is closed at
  the end. The prompt the model sees is rebuilt from this reset's observation (the same as the row's for BabyAI,
  TextCraft and SearchQA; SciWorld's object order and WebArena's element ids change between resets). The trace's
  reward `reward` is our episode's reward (its last step's); trace.info["steps"] holds every step's observation,
  reward and done. An env that fails (a dead JVM or browser) fails that episode (its errors), not the run.
- ChatHarness: verifiers' own chat harnesses (null, bash) install a Python program with uv and its packages from
  the network at every new environment; this one makes the same chat call in this process, one call a turn, so
  an eval runs offline. Its runtime is a local subprocess box (nothing runs in it).

How verifiers resolves an id (verifiers/v1/utils/loaders.py): `<id>` with dashes as underscores is imported as
`verifiers.v1.tasksets.<module>`, else as the top-level module `<module>`, which must export one Taskset (and may
export one Env and one Harness) in `__all__`. A dotted id (envs.standards.verifiers_env) fails in that lookup, so
this module registers itself as the top-level module `agentgym_rl` when it is imported: `vf.load_environment` then
resolves the id `agentgym-rl` in any process that imported it, with nothing installed. verifiers' CLIs (vf-eval,
prime-rl's env servers) import only by name, so `python -m envs.standards.verifiers_env ARGS` runs vf-eval with the
id registered (its ARGS are vf-eval's). A per-step reward, groups and the token ids of training are verifiers' and
prime-rl's business: a group is `-r n` episodes of one row.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import verifiers.v1 as vf
from pydantic import Field, field_validator
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult
from verifiers.v1.types import content_text

import envs

ID = "agentgym-rl"  # the id verifiers resolves to this module (the module name agentgym_rl, registered below)


class AgentGymConfig(vf.TasksetConfig):
    env: str = "babyai"
    """Which of our envs (envs.ENVS)."""
    split: Literal["train", "test"] = "train"
    """The split whose task ids are the rows (envs.splits)."""
    num_tasks: int | None = Field(None, ge=1)
    """The split's first num_tasks task ids (None: all)."""
    task_ids: list[int] | None = None
    """These task ids instead of a split's."""
    horizon: int | None = Field(None, ge=1)
    """Env steps before an episode is cut (None: the env's upstream horizon, envs.ENVS)."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options for envs.make (WebArena: sites local)."""

    @field_validator("env")
    @classmethod
    def known_env(cls, name: str) -> str:
        envs.registration(name)  # (ValueError naming the envs there are)
        return name


class AgentGymData(vf.TaskData):
    task_id: int
    """Our env's task id (id is AgentGym's item id, <env>_<task id>)."""


class AgentGymTask(vf.Task[AgentGymData, vf.State, vf.TaskConfig]):
    @property
    def key(self) -> str:
        return self.data.id


def opening(env: envs.Env, observation: str) -> vf.Messages:
    """The first three messages of an episode, as rl/agent.py's react format lays them out (tested equal)."""
    return [vf.UserMessage(content=env.instruction), vf.AssistantMessage(content=env.ack),
            vf.UserMessage(content=observation)]


class AgentGymTaskset(vf.Taskset[AgentGymTask, AgentGymConfig]):
    def task_ids(self) -> list[int]:
        config = self.config
        if config.task_ids is not None:
            return list(config.task_ids)
        return envs.splits(config.env)[config.split][:config.num_tasks]

    def load(self) -> Iterator[AgentGymTask]:
        config = self.config
        env = envs.make(config.env, **config.env_options)
        try:
            for task_id in self.task_ids():
                data = AgentGymData(id=f"{config.env}_{task_id}", name=f"{config.env} task {task_id}",
                                    prompt=opening(env, env.reset(task_id)), task_id=task_id)
                yield AgentGymTask(data, config.task)
        finally:
            env.close()


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion a turn, in this process, through the rollout's interception endpoint (which applies
    the run's model and sampling and records the turn on the trace)."""

    APPENDS_SYSTEM_PROMPT = True  # a task's system prompt goes as a system message
    SUPPORTS_RESUME = True  # a later turn is the whole conversation again (verifiers' default resume)
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        prompt = [{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str) else \
            [message_to_wire(message) for message in data.prompt or []]
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        async with httpx.AsyncClient(timeout=None) as http:  # (the rollout's own timeouts bound the call)
            answer = await http.post(f"{endpoint}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                     json={"model": ctx.model, "messages": system + prompt})
        return ProgramResult(exit_code=0 if answer.is_success else 1, stdout="",
                             stderr="" if answer.is_success else f"HTTP {answer.status_code}: {answer.text[:2000]}")


class AgentGymEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime={"type": "subprocess"})
    """The seat the policy plays (--env.agent.*): the chat harness needs no container."""


class AgentGymEnv(vf.Env[AgentGymEnvConfig]):
    async def run(self, task: AgentGymTask, agents) -> None:
        config = self.taskset.config
        horizon = config.horizon or envs.registration(config.env).upstream_horizon
        env = await asyncio.to_thread(envs.make, config.env, **config.env_options)
        steps: list[dict] = []
        try:
            observation = await asyncio.to_thread(env.reset, task.data.task_id)
            task = task.with_data(prompt=opening(env, observation))
            async with agents.agent.interaction(task) as interaction:
                segment = await interaction.turn()
                while not segment.terminated:
                    result = await asyncio.to_thread(env.step, reply(segment))
                    steps.append({"observation": result.observation, "reward": result.reward, "done": result.done})
                    if result.done or len(steps) == horizon:
                        break
                    segment = await interaction.turn(result.observation)
        finally:
            await asyncio.to_thread(env.close)
        interaction.trace.record_reward("reward", steps[-1]["reward"] if steps else 0.0)
        interaction.trace.info["steps"] = steps


def reply(segment: vf.Segment) -> str:
    """The model's reply as it wrote it (Segment.last_reply strips it; our envs take the text as it is)."""
    return next(content_text(m.content) for m in reversed(segment.messages) if isinstance(m, vf.AssistantMessage))


__all__ = ["AgentGymTaskset", "AgentGymEnv", "ChatHarness", "load_environment"]

# verifiers imports a taskset by its top-level module name (see the module docstring)
sys.modules.setdefault(ID.replace("-", "_"), sys.modules[__name__])


def load_environment(env: str = "babyai", split: Literal["train", "test"] = "train", num_tasks: int | None = None,
                     task_ids: list[int] | None = None, horizon: int | None = None, **env_options) -> vf.Env:
    """Our env `env` as a verifiers Env, loaded by verifiers' own loader from the id agentgym-rl."""
    config = vf.resolve_env_config({"taskset": {"id": ID, "env": env, "split": split, "num_tasks": num_tasks,
                                                "task_ids": task_ids, "horizon": horizon, "env_options": env_options}})
    return vf.load_environment(config)


def parse_args(argv: list[str]):
    """vf-eval's run config from its command line `argv` (what `python -m envs.standards.verifiers_env argv` runs)."""
    from pydantic_config import cli
    from verifiers.v1.cli.resolve import narrow_config, with_positional_taskset
    from verifiers.v1.configs.cli.eval import EvalConfig

    argv = with_positional_taskset(list(argv))
    return cli(narrow_config(EvalConfig, argv), args=argv)


if __name__ == "__main__":
    import importlib

    from verifiers.v1.cli.eval.main import main

    # (this file runs as __main__: the id names the module that `import envs.standards.verifiers_env` makes)
    sys.modules[ID.replace("-", "_")] = importlib.import_module("envs.standards.verifiers_env")
    main()
