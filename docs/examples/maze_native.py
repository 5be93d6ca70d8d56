"""The maze as one of our own envs: saved as envs/maze.py beside one line in envs.ENVS (docs/bring-your-own-env.md).
What only this route gives: a scripted expert (oracle: SFT data), a state key (GiGPO's step-level groups), fork
(--group-start fork), native tools (--agent tools) and categories (eval.py's per-category scores)."""

import copy
from collections import deque
from typing import Callable

from docs.examples.maze import MOVES, Maze, carve
from envs import REACT_ONLY_ONE, Env, StepResult, react_action
from envs.tools import Param, Tool

INSTRUCTION = (f"{Maze.metadata['description']}\nReply with your reasoning, then your move, in this format:\n"
               "Thought: I think ...\nAction: north")
ACK = "OK. I'll find the exit."
TOOLS = (Tool("go", "Go through a door of this room.", {"door": Param("string", "the door", enum=tuple(MOVES))},
              "{door}"),)
REPLY = "Action: {action}"  # how a reply carries a tool call's action


def read_action(text: str) -> str | None:
    """The move a reply sends: AgentGym's ReAct parsing of its one `Action:` line (None where it has several)."""
    return react_action(text)


class MazeEnv(Env):
    name, instruction, ack = "maze", INSTRUCTION, ACK

    def __init__(self, size: int = 3):
        self.game = Maze(size)

    def reset(self, task_id: int) -> str:
        return self.game.reset(seed=task_id)[0]

    def step(self, text: str) -> StepResult:
        move = read_action(text)
        if move is None:
            return StepResult(REACT_ONLY_ONE, 0.0, False, {"valid": False})
        said, reward, terminated, truncated, info = self.game.step(move)
        return StepResult(said, reward, terminated or truncated, {"valid": info.get("valid", True)})

    def state_key(self) -> str:
        return str(self.game.room)  # where the next move starts, however the agent got there

    def fork(self) -> "MazeEnv":
        twin = copy.copy(self)
        twin.game = copy.deepcopy(self.game)
        return twin


def make(size: int = 3) -> MazeEnv:
    return MazeEnv(size)


def shortest(exits: dict, start: tuple, goal: tuple) -> list[str]:
    """The moves of a shortest way from start to goal (breadth-first search)."""
    ways, todo = {start: []}, deque([start])
    while todo:
        room = todo.popleft()
        for move in sorted(exits[room]):
            after = (room[0] + MOVES[move][0], room[1] + MOVES[move][1])
            if after not in ways:
                ways[after] = ways[room] + [move]
                todo.append(after)
    return ways[goal]


def category(task_id: int) -> str:
    """How far the exit is (on the default 3 x 3 maze): eval.py scores each category apart."""
    return f"{len(shortest(carve(3, task_id), (0, 0), (2, 2)))} moves"


def oracle(env: MazeEnv) -> Callable[[str], str]:
    """The expert: the first move of a shortest way out of the room the agent is in."""
    def act(observation: str) -> str:
        move = shortest(env.game.exits, env.game.room, env.game.exit)[0]
        return f"Thought: I go {move}.\nAction: {move}"
    return act


def default_splits() -> dict[str, list[int]]:
    return {"train": list(range(1000)), "test": list(range(1000, 1100))}
