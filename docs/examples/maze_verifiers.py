"""The maze as a verifiers (0.4, verifiers.v1) taskset and env: `--env verifiers:maze_verifiers` with docs/examples on
PYTHONPATH (verifiers imports a taskset by a module name without dots; docs/bring-your-own-env.md). A row is a seed;
the taskset is endless, as seeded games are."""

import itertools

import verifiers.v1 as vf

from docs.examples.maze import Maze


class MazeData(vf.TaskData):
    seed: int
    size: int


class MazeTask(vf.Task[MazeData, vf.State, vf.TaskConfig]):
    pass


class MazeConfig(vf.TasksetConfig):
    size: int = 3


class MazeTaskset(vf.Taskset[MazeTask, MazeConfig]):
    INFINITE = True

    def load(self):
        for seed in itertools.count():
            first, _ = Maze(self.config.size).reset(seed)
            data = MazeData(prompt=first, system_prompt=Maze.metadata["description"], seed=seed, size=self.config.size)
            yield MazeTask(data, self.config.task)


class MazeEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class MazeEnv(vf.Env[MazeEnvConfig]):
    async def run(self, task, agents):
        game, reward = Maze(task.data.size), 0.0
        game.reset(task.data.seed)
        async with agents.player.interaction(task) as exchange:
            segment = await exchange.turn()
            while not segment.terminated:
                said, reward, terminated, truncated, _ = game.step(segment.last_reply)
                if terminated or truncated:
                    break
                segment = await exchange.turn(said)
        exchange.trace.record_reward("escaped", reward)


__all__ = ["MazeTaskset", "MazeEnv"]
