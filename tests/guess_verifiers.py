"""Guess as a verifiers (0.4, verifiers.v1) taskset for tests/test_standards.py (`--env verifiers:guess_verifiers`, with
tests/ on sys.path: verifiers imports a taskset by a module name without dots). Twenty rows, each a secret from 1 to 8
(row i: i % 8 + 1). GuessEnv, the taskset's own Env, answers each guess higher or lower for up to `turns` guesses and
is scored by the task's @vf.reward (1 when the last reply is the secret); in vf's single_agent env (--env-options env
single_agent) a row is one reply, scored the same."""

from __future__ import annotations

import verifiers.v1 as vf

SYSTEM = "Guess the secret number from 1 to 8."


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == str(task.secret))


class GuessConfig(vf.TasksetConfig):
    rows: int = 20


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        for i in range(self.config.rows):
            yield GuessTask(GuessData(prompt="Your guess?", system_prompt=SYSTEM, secret=i % 8 + 1), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    turns: int = 4


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret = task.data.secret
        async with agents.player.interaction(task) as exchange:
            segment = await exchange.turn()
            for _ in range(self.config.turns - 1):
                if segment.terminated or segment.last_reply == str(secret):
                    break
                guess = int(segment.last_reply) if segment.last_reply.isdigit() else 0
                segment = await exchange.turn("Higher." if guess < secret else "Lower.")


__all__ = ["GuessTaskset", "GuessEnv"]
