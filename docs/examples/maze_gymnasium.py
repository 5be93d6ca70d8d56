"""The maze as a Gymnasium env, registered by id: `--env gym:docs.examples.maze_gymnasium:TextMaze-v0`
(docs/bring-your-own-env.md). What an env you already have looks like: a gymnasium.Env with text spaces."""

import string

import gymnasium
from gymnasium.spaces import Text

from docs.examples.maze import Maze


class TextMaze(gymnasium.Env):
    metadata = {**Maze.metadata, "render_modes": []}

    def __init__(self, size: int = 3, max_turns: int = 12):
        self.game = Maze(size, max_turns)
        self.observation_space = Text(1000, charset=string.printable)
        self.action_space = Text(1000, charset=string.printable)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        return self.game.reset(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return self.game.step(action)


gymnasium.register("TextMaze-v0", entry_point=TextMaze)
