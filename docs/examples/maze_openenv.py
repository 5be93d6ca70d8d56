"""The maze as an OpenEnv Environment: in process, `--env openenv:docs.examples.maze_openenv.MazeEnvironment`, or
served by OpenEnv's own server, `python -m uvicorn docs.examples.maze_openenv:app --port 8000`, and played as
`--env openenv:http://127.0.0.1:8000` (docs/bring-your-own-env.md)."""

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State

from docs.examples.maze import Maze


class MazeAction(Action):
    move: str


class MazeObservation(Observation):
    text: str


class MazeEnvironment(Environment[MazeAction, MazeObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, size: int = 3):
        super().__init__()
        self.game = Maze(size)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> MazeObservation:
        text, _ = self.game.reset(seed)
        return MazeObservation(text=text)

    def step(self, action: MazeAction, timeout_s: float | None = None, **kwargs) -> MazeObservation:
        text, reward, terminated, truncated, _ = self.game.step(action.move)
        return MazeObservation(text=text, reward=reward, done=terminated or truncated)

    @property
    def state(self) -> State:
        return State(step_count=self.game.turns)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="MazeEnvironment", description=Maze.metadata["description"])


app = create_app(MazeEnvironment, MazeAction, MazeObservation, max_concurrent_envs=64)
