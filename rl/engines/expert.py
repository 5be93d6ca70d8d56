"""ExpertEngine: the envs' scripted experts behind the engine contract (rl/engines), for SFT data and tests."""

from __future__ import annotations

import envs as envs_lib
import envs.tools  # noqa: F401 - envs_lib.tools: the experts' calls under --agent tools
from rl.engines import RoundEngine, Sample


SUMMARY = "So far I have acted on what I was shown; the task stands as stated."  # (a summary turn: --context summary)


class ExpertEngine(RoundEngine):
    """The envs' scripted experts (envs.oracle) behind the engine interface: each "sample" is the
    expert's response to the latest observation (under --agent tools, the tool call that stands for
    it, written as the chat template writes calls), tokenized, plus the end-of-turn token. Makes SFT
    data, and test rollouts, with exactly the token layout of RL rollouts."""

    name = "expert"

    def __init__(self, fmt, environments: list):
        super().__init__()
        self.fmt, self.environments, self.experts = fmt, environments, {}

    def generate(self, batch: list, limits: list[int]) -> list[Sample]:
        samples = []
        for traj, limit in zip(batch, limits):
            if traj.turns == 0:  # first turn after a reset: a fresh expert for this episode
                self.experts[traj.row] = envs_lib.oracle(self.environments[traj.row])
            try:  # (the env's last answer as the prompt holds it: after a summary, without the request)
                summarizing = traj.context.summarizing
                text = SUMMARY if summarizing else self.experts[traj.row](traj.prompt_messages()[-1]["content"])
            except RuntimeError as error:  # a task this expert cannot play
                samples.append(Sample([], error=f"expert failed: {error}"))
                continue
            if traj.tools and not summarizing:  # --agent tools: the expert's action as the one call that stands for it
                text = self.fmt.call_text(*envs_lib.tools.call_of(traj.env, text))
            ids = (self.fmt.encode(text) + [self.fmt.end_of_turn])[:max(limit, 0)]
            samples.append(Sample(ids, [0.0] * len(ids)))
        return samples
