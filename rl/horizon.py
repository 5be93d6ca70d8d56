"""ScalingInter-RL: the interaction horizon (turn cap) as a schedule over training steps.

The paper's main method: start with short episodes, where the reward signal is dense enough to learn
from and the policy cannot drift into long aimless explorations, then let episodes grow in stages.
`--horizon 10 20 30 --horizon-every 100` caps steps 1-100 at 10 turns, 101-200 at 20, and every step
after that at 30; a single value is a fixed horizon (AgentGym-RL's baseline). The cap only limits
episodes: one that ends earlier (done, token budget) ends earlier.

The schedule is a pure function of the step number, so a resumed run continues exactly where it
stopped. (Upstream keeps a counter that is restored one step behind after a resume, so its stage
changes come one step early from then on.)
"""

from __future__ import annotations

from typing import Sequence


def horizon_at(step: int, caps: Sequence[int], every: int) -> int:
    """The turn cap at training step `step` (1-based): caps[0] for steps 1..every, caps[1] for the next
    `every` steps, and so on, the last cap for the rest of training."""
    if step < 1:
        raise ValueError(f"training steps count from 1, got {step}")
    if not caps or every < 1:
        raise ValueError("a horizon schedule needs at least one cap and a stage length of at least 1 step")
    return caps[min((step - 1) // every, len(caps) - 1)]


def describe(caps: Sequence[int], every: int, steps: int) -> str:
    """'15 turns' or 'horizon 10 (1-100), 20 (101-200), 30 (201-300) turns' for the run's banner."""
    if len(caps) == 1:
        return f"{caps[0]} turns"
    parts = []
    for stage, cap in enumerate(caps):
        first = stage * every + 1
        if first > steps:
            break
        last = steps if stage == len(caps) - 1 else min((stage + 1) * every, steps)
        parts.append(f"{cap} ({first}-{last})")
    return "horizon " + ", ".join(parts) + " turns"
