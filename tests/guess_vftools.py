"""Guess as a verifiers (0.4, verifiers.v1) taskset with tools, for tests/test_standard_tools.py (`--env
verifiers:guess_vftools`, with tests/ on sys.path). Twenty rows, each a secret from 1 to 8 (row i: i % 8 + 1). Each
task gets a tool server of its own (Task.toolsets), GuessToolset: `guess(number)` answers higher, lower or correct and
counts the guesses in the rollout's state, `parity()` says whether the secret is even; `guess` of a number outside 1 to
8 fails (raises). With `task.pictures` True a second toolset, CameraToolset, has `picture()`: a line of text and a PNG
(an image in a tool's result, tests/test_standard_tools.py). The task's rubric scores the final answer (1 when it is
the secret) and a @vf.stop ends the episode after `max_guesses` guesses, both as verifiers runs them. Run as a module,
the toolset serves itself as verifiers' harness launches it (`python -m guess_vftools`)."""

from __future__ import annotations

import verifiers.v1 as vf

SYSTEM = "Find the secret number from 1 to 8 with the tools, then give it as your final answer."


class GuessState(vf.State):
    guesses: int = 0


class GuessToolset(vf.Toolset[vf.ToolsetConfig, GuessState]):
    async def setup_task(self, task) -> None:
        self.secret = task.data.secret

    @vf.tool
    def guess(self, number: int) -> str:
        """Guess the secret number."""
        if not 1 <= number <= 8:
            raise ValueError(f"{number} is not a number from 1 to 8")
        self.state.guesses += 1
        return "Correct!" if number == self.secret else "Higher." if number < self.secret else "Lower."

    @vf.tool
    def parity(self) -> str:
        """Whether the secret number is even or odd."""
        return "even" if self.secret % 2 == 0 else "odd"


PNG = bytes.fromhex("89504e470d0a1a0a") + bytes(3000)  # (a PNG's signature and 3,000 bytes: 4,000 of base64)


class CameraToolset(vf.Toolset[vf.ToolsetConfig, GuessState]):
    TOOL_PREFIX = "camera"

    @vf.tool
    def picture(self):
        """A picture of the secret number."""
        from mcp.server.mcpserver.utilities.types import Image

        return ["Here it is:", Image(data=PNG, format="png")]


class GuessData(vf.TaskData):
    secret: int


class GuessConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()
    max_guesses: int = 3
    pictures: bool = False


class GuessTask(vf.Task[GuessData, GuessState, GuessConfig]):
    @classmethod
    def toolsets(cls, config: GuessConfig) -> list[vf.Toolset]:
        return [GuessToolset(config.tools)] + [CameraToolset(config.tools)] * config.pictures

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == str(task.secret))

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(trace.state.guesses)

    @vf.stop
    async def out_of_guesses(self, trace: vf.Trace) -> bool:
        return trace.state.guesses >= self.config.max_guesses


class GuessTasksetConfig(vf.TasksetConfig):
    task: GuessConfig = GuessConfig()
    rows: int = 20


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for i in range(self.config.rows):
            yield GuessTask(GuessData(prompt="Which number is it?", system_prompt=SYSTEM, secret=i % 8 + 1),
                            self.config.task)


__all__ = ["GuessTaskset"]

if __name__ == "__main__":
    GuessToolset.run()
