"""ScalingInter-RL: the interaction horizon (turn cap) as a schedule over training steps.

The paper's main method: start with short episodes, where the reward signal is dense enough to learn
from and the policy cannot drift into long aimless explorations, then let episodes grow in stages.
`--horizon 10 20 30 --horizon-every 100` caps steps 1-100 at 10 turns, 101-200 at 20, and every step
after that at 30; a single value is a fixed horizon (AgentGym-RL's baseline). The cap only limits
episodes: one that ends earlier (done, token budget) ends earlier.

The schedule is a pure function of the step number, so a resumed run continues exactly where it
stopped. (Upstream keeps a counter that is restored one step behind after a resume, so its stage
changes come one step early from then on.)

`--horizon auto 3 6` (not upstream's: ScalingInter-RL's stages come at steps a user must guess) climbs the same
ladder of caps when the run shows it is time (`auto_horizon`), never lower: after at least `patience` steps at a
cap, the next cap comes when the cap has stopped mattering (it cut at most `cut` of the last `patience` steps'
episodes) or when success has stopped improving at it (the last `patience` steps' mean success is not `gain` above
the `patience` steps' before). `--horizon auto` alone climbs the preset's stages, or the ScalingInter-RL recipe's
10 20 30. With several envs (train.py --env babyai textcraft) each env climbs the ladder on its own episodes'
metrics (env_rows: rollout/<env>/), each playing under its own cap (rl/limits.py's caps_at, which also gives an env
its own stages: --env-limits). The cap is a pure function of the logged
metrics (metrics.jsonl's rows), so `--resume` reproduces it;
under --max-staleness k the cap of step j is decided from the steps up to j - k - 2, the ones finished when step j's
episodes begin (`known_before`).
"""

from __future__ import annotations

from typing import Sequence

from rl import staleness as rule

AUTO = "auto"
LADDER = (10, 20, 30)  # what `--horizon auto` alone climbs when the preset has one cap: the ScalingInter-RL recipe's


def horizon_at(step: int, caps: Sequence[int], every: int) -> int:
    """The turn cap at training step `step` (1-based): caps[0] for steps 1..every, caps[1] for the next
    `every` steps, and so on, the last cap for the rest of training."""
    if step < 1:
        raise ValueError(f"training steps count from 1, got {step}")
    if not caps or every < 1:
        raise ValueError("a horizon schedule needs at least one cap and a stage length of at least 1 step")
    return caps[min((step - 1) // every, len(caps) - 1)]


def describe(caps: Sequence[int], every: int, steps: int) -> str:
    """'15 turns' or 'horizon 10 (1-100), 20 (101-200), 30 (201-300) turns' for the run's banner (`--horizon auto`'s:
    'horizon auto 10, 20, 30 turns')."""
    if caps and caps[0] == AUTO:
        return f"horizon auto {', '.join(map(str, caps[1:]))} turns"
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


def caps_of(horizon: Sequence) -> tuple[int, ...]:
    """The turn caps of a --horizon value: (10, 20, 30) of `10 20 30` and of `auto 10 20 30`."""
    return tuple(cap for cap in horizon if cap != AUTO)


def known_before(step: int, staleness: int | None) -> int:
    """The last step whose metrics decide step `step`'s cap: the last one finished when its episodes begin (the
    staleness rule, rl/staleness.py; --max-staleness none is 0)."""
    return rule.known_before(step, staleness or 0)


def auto_horizon(caps: Sequence[int], rows: list[dict], patience: int, cut: float, gain: float) -> tuple[int, str]:
    """`--horizon auto`'s cap after the steps of `rows` (metrics.jsonl's step rows, oldest first: their charts/step,
    rollout/horizon, rollout/success and finish/horizon, the share of episodes the cap cut), and why it holds. The
    rule runs over the rows as the run did: rows played at a lower cap than the current one (episodes begun before a
    raise, under --max-staleness) are not the current cap's."""
    cap, reason, at_cap = caps[0], f"the first cap of {'-'.join(map(str, caps))}", []
    for row in rows:
        if row["rollout/horizon"] != cap:
            continue
        at_cap.append(row)
        why = _time_to_raise(at_cap, patience, cut, gain)
        if why is not None and cap != caps[-1]:
            cap, reason, at_cap = caps[caps.index(cap) + 1], f"from {cap} after step {row['charts/step']}: {why}", []
    return cap, reason


def env_rows(rows: list[dict], name: str) -> list[dict]:
    """The rows of a run on several envs as auto_horizon reads them for env `name`: its own cap, success and share of
    episodes cut (rl/metrics.py's rollout/<env>/), so that each env climbs the ladder when its own episodes say so."""
    return [{"charts/step": row["charts/step"], "rollout/horizon": row[f"rollout/{name}/horizon"],
             "rollout/success": row[f"rollout/{name}/success"], "finish/horizon": row[f"rollout/{name}/finish/horizon"]}
            for row in rows if f"rollout/{name}/horizon" in row]


def _time_to_raise(rows: list[dict], patience: int, cut: float, gain: float) -> str | None:
    """Why the cap of these rows (all played at it) should grow now, or None."""
    if len(rows) < patience:
        return None
    last = rows[-patience:]
    span = f"steps {last[0]['charts/step']}-{last[-1]['charts/step']}"
    cut_share = sum(r["finish/horizon"] for r in last) / patience
    if cut_share <= cut:
        return f"it cut {cut_share:.0%} of the episodes of {span} (at most {cut:.0%}: the cap no longer binds)"
    if len(rows) >= 2 * patience:
        now = sum(r["rollout/success"] for r in last) / patience
        before = sum(r["rollout/success"] for r in rows[-2 * patience:-patience]) / patience
        if now < before + gain:
            return f"success {now:.3f} over {span}, {before:.3f} before (not {gain:g} better: it stopped improving)"
    return None
