"""Avg@k and Pass@k, overall and per category, as AgentGym-RL computes them: eval.py's scores, and
the periodic evaluations of train.py.

    results = score(trajectories, "babyai")   # {"avg@k", "pass@k", "success", ..., "categories": {...}}

Avg@k is the mean final score over every episode (the raw env score: BabyAI's fractional reward,
SciWorld's 0-100 progress); Pass@k is the share of tasks where at least one of its k episodes scored
above 0. An episode that ended in an env failure is scored 0 and counted under `errors`. How the episodes
ended (`finish`: the env said done, the turn cap, the token budget, an env failure) goes with every score,
and every summary says it (`endings`): episodes cut by the token budget score what the budget allowed, not
what the agent can do.

Under --agent reflect an episode is a task's series of attempts, scored by its last attempt (the one that
succeeded, or the last one played); `by_attempt` then gives, for each attempt a, the success rate of the
episodes as they stood after attempt a and the share of tasks solved by one of their episodes by then.

eval.py's results file is written here (per_task, result_text), and its tables are here too: several envs' scores
with their macro average (macro, env_table), a turn-budget sweep (sweep_table), and two results compared per category
with paired intervals (compare_rows).
"""

from __future__ import annotations

import json
from collections import defaultdict

import envs
from rl.trajectory import Trajectory, category


def spread(task_ids: list[int], n: int) -> list[int]:
    """n ids evenly spaced over the list: splits are often sorted by category, so the first n would
    all come from one."""
    return task_ids if n >= len(task_ids) else [task_ids[i * len(task_ids) // n] for i in range(n)]


# How an episode ended (rollout.Trajectory's finish) -> its name in metrics (finish/<name>, eval/finish/<name>) and
# summaries
FINISHES = {"done": "done", "horizon": "horizon", "max_tokens": "max_tokens", "error": "error"}


def final(episode) -> bool:
    """Whether an episode counts in a score: under --agent reflect only its task's last attempt does (anything without
    an `attempt` record, as a log's row, is one)."""
    attempt = getattr(episode, "attempt", None)
    return attempt is None or attempt.final


def score(trajectories: list[Trajectory], env_name: str, score_max: float = 1.0) -> dict:
    """Avg@k and Pass@k overall and per category, from one list of episodes (anything with task_id,
    reward, success, turns, finish and error, as a Trajectory; reflect's also `attempt`), and
    the shares of the episodes by how they ended (`finish`, by FINISHES' names). `score_max`, the env's best
    score (envs.score_max), goes with them: a macro average over envs takes Avg@k as a share of it (macro)."""
    finals = [t for t in trajectories if final(t)]
    by_task = defaultdict(list)
    for t in finals:
        by_task[t.task_id].append(t)

    def summary(task_ids):
        episodes = [t for task in task_ids for t in by_task[task]]
        return {
            "tasks": len(task_ids),
            "avg@k": sum(t.reward for t in episodes) / len(episodes),
            "pass@k": sum(any(t.reward > 0 for t in by_task[task]) for task in task_ids) / len(task_ids),
            "success": sum(t.success for t in episodes) / len(episodes),
            "turns": sum(t.turns for t in episodes) / len(episodes),
            "errors": sum(t.error is not None for t in episodes),
            # turns the env refused or could not read (rl/trajectory.py's invalid_actions: info["valid"] False, and the
            # replies answered without the env below), as train.py's rollout/invalid_action_rate
            "invalid_action_rate": sum(getattr(t, "invalid_actions", 0) for t in episodes)
            / max(sum(t.turns for t in episodes), 1),
            # of those, turns whose reply held no action the env could take (no or a malformed tool call, a reply cut inside
            # its reasoning): 1 - this is --agent tools' valid-call rate
            "malformed": sum(getattr(t, "malformed", 0) for t in episodes) / max(sum(t.turns for t in episodes), 1),
            # what a turn's prompt held (--context, --max-obs-tokens): the mean and largest, and the observations cut
            "prompt_tokens": sum(sum(getattr(t, "prompt_tokens", [])) for t in episodes)
            / max(sum(len(getattr(t, "prompt_tokens", [])) for t in episodes), 1),
            "prompt_tokens_max": max((n for t in episodes for n in getattr(t, "prompt_tokens", [])), default=0),
            "obs_cut": sum(getattr(t, "obs_cut", 0) for t in episodes) / max(sum(getattr(t, "observations", 0)
                                                                                 for t in episodes), 1),
        }

    categories = defaultdict(list)
    for task in by_task:
        categories[envs.category(env_name, task)].append(task)
    results = {**summary(list(by_task)), "score_max": score_max,
               "finish": {name: sum(t.finish == finish for t in finals) / max(len(finals), 1) for finish, name in FINISHES.items()},
               "categories": {c: summary(ids) for c, ids in sorted(categories.items())}}
    played = max((t.attempt.number for t in finals if hasattr(t, "attempt")), default=1)
    if played > 1:  # reflect: where the episodes stood after each attempt
        won = {task: [t.attempt.number if t.success else None for t in episodes] for task, episodes in by_task.items()}
        results["by_attempt"] = [{"attempt": a, "success": sum(w is not None and w <= a for ws in won.values() for w in ws)
                                / len(finals),
                                "solved": sum(any(w is not None and w <= a for w in ws) for ws in won.values()) / len(won)}
                               for a in range(1, played + 1)]
    return results


def cells(summary: dict, k: int) -> str:
    """A summary's scores on one line (score's overall or a category's): Avg@k, Pass@k, turns, invalid actions."""
    return (f"Avg@{k} {summary['avg@k']:.4f}  Pass@{k} {summary['pass@k']:.4f}  turns {summary['turns']:.1f}  "
            f"invalid actions {summary['invalid_action_rate']:.1%}")


def actions(summary: dict, agent: str) -> str | None:
    """A summary's line on its actions, where there is something to say: the replies that held one (under --agent
    tools always, else when some did not), and a warning when the env refused or could not read most turns'."""
    parts = []
    if agent == "tools" or summary["malformed"]:
        parts.append(f"valid replies {1 - summary['malformed']:.1%} of turns (the rest held no action: "
                     + ("no call or a malformed one, or " if agent == "tools" else "") + "cut inside the reasoning)")
    if summary["invalid_action_rate"] > 0.5:
        parts.append(f"warning: the env refused or could not read {summary['invalid_action_rate']:.0%} of the turns' "
                     f"actions: the model rarely acts as the {agent} layout asks, so the scores say more about the "
                     "format than the task")
    return " - ".join(parts) or None


def endings(finish: dict[str, float], max_tokens: int) -> str:
    """A summary's line on how its episodes ended (score's `finish`), with a warning when most of them ran out of
    their `max_tokens` budget."""
    line = "ended: " + ", ".join(f"{name} {finish[name]:.0%}" for name in FINISHES.values())
    if finish["max_tokens"] > 0.5:
        line += (f" - warning: most episodes ran out of their {max_tokens}-token budget before the env or the turn cap "
                 "ended them, so the scores say more about the budget than the agent: raise --max-tokens")
    return line


def gain(before, after) -> dict:
    """How much `after`'s success beats `before`'s on the same tasks, with a 95% confidence interval: the
    per-task success rates (the mean over a task's episodes) paired by task (see paired). Episodes are anything
    with task_id and success."""
    def rates(episodes):
        by_task = defaultdict(list)
        for t in episodes:
            by_task[t.task_id].append(float(t.success))
        return {task: sum(v) / len(v) for task, v in by_task.items()}

    return paired(rates(before), rates(after))


def paired(before: dict, after: dict) -> dict:
    """The mean of after[task] - before[task] over the tasks both have, with a 95% confidence interval: the
    normal one on the mean of the per-task differences (the tasks are the sample; a task's k episodes are not
    independent draws of the population; with few tasks a normal interval is optimistic). Tasks that only one
    side has are left out; with one task in common there is no interval (low and high are None)."""
    tasks = sorted(set(before) & set(after))
    if not tasks:
        raise ValueError("the two evaluations have no task in common")
    differences = [after[t] - before[t] for t in tasks]
    mean = sum(differences) / len(tasks)
    variance = sum((d - mean) ** 2 for d in differences) / max(len(tasks) - 1, 1)
    half = 1.96 * (variance / len(tasks)) ** 0.5
    low, high = (mean - half, mean + half) if len(tasks) > 1 else (None, None)
    return {"before": sum(before[t] for t in tasks) / len(tasks), "after": sum(after[t] for t in tasks) / len(tasks),
            "gain": mean, "low": low, "high": high, "tasks": len(tasks)}


# ----------------------------------------------------------------------------------------------
# Tables of scores (eval.py's)


def macro(results: dict[str, dict]) -> dict[str, float]:
    """Several envs' scores averaged, each env weighing the same: Pass@k and success as they are, Avg@k as a share of
    each env's best score (SciWorld's 0-100 scores as 0-1), so that one env's scale does not swamp the others."""
    return {"avg@k": sum(r["avg@k"] / r.get("score_max", 1.0) for r in results.values()) / len(results),
            **{key: sum(r[key] for r in results.values()) / len(results) for key in ("pass@k", "success")}}


def env_table(results: dict[str, dict], macro: dict, k: int) -> str:
    """Several envs' scores, a row each, and their macro average (`macro`)."""
    rows = [f"{'env':<12} {'tasks':>6}  {f'Avg@{k}':>8} {f'Pass@{k}':>8} {'success':>8}"]
    rows += [f"{env:<12} {r['tasks']:>6}  {r['avg@k']:>8.4f} {r['pass@k']:>8.4f} {r['success']:>8.4f}"
             for env, r in results.items()]
    return "\n".join([*rows, f"{'macro':<12} {'':>6}  {macro['avg@k']:>8.4f} {macro['pass@k']:>8.4f} "
                                f"{macro['success']:>8.4f}"])


def sweep_table(sweep: list[dict], k: int) -> str:
    """Avg@k / Pass@k against the turn cap, overall and per category, one row per cap."""
    names = ["overall", *sweep[0]["categories"]]
    head = f"{'turns':>5}  " + "  ".join(f"{name[:22]:>22}" for name in names)
    rows = [head, f"{'':>5}  " + "  ".join(f"{f'Avg@{k} / Pass@{k}':>22}" for _ in names)]
    for row in sweep:
        cells = [row] + [row["categories"][name] for name in names[1:]]
        rows.append(f"{row['horizon']:>5}  " + "  ".join(f"{c['avg@k']:>10.3f} / {c['pass@k']:<9.3f}" for c in cells))
    return "\n".join(rows)


def compare_rows(a: dict, b: dict) -> list[dict]:
    """compare()'s rows: overall, then each category either result has."""
    env = a["env"]
    tasks_a, tasks_b = a.get("per_task", {}), b.get("per_task", {})
    names = ["overall", *sorted(set(a.get("categories", {})) | set(b.get("categories", {}))
                                | {category(env, int(t)) for t in [*tasks_a, *tasks_b]} - {None})]
    rows = []
    for name in names:
        def mine(tasks):
            return {t: v for t, v in tasks.items() if name == "overall" or category(env, int(t)) == name}

        pa, pb = mine(tasks_a), mine(tasks_b)
        row = {"category": name, "tasks": len(set(pa) & set(pb))}
        for metric, column in (("avg", 0), ("success", 1)):
            means_a = {t: sum(e[column] for e in v) / len(v) for t, v in pa.items()}
            means_b = {t: sum(e[column] for e in v) / len(v) for t, v in pb.items()}
            if row["tasks"]:
                row[metric] = paired(means_a, means_b)
            else:  # no per-task scores: the summaries only
                key = "avg@k" if metric == "avg" else "success"
                x, y = (r if name == "overall" else r.get("categories", {}).get(name, {}) for r in (a, b))
                row[metric] = {"before": x.get(key, float("nan")), "after": y.get(key, float("nan")), "tasks": 0}
        rows.append(row)
    return rows


def per_task(trajectories) -> dict[str, list[list[float]]]:
    """Each task's episodes as [reward, success] pairs (its final attempts under reflect): what --compare pairs."""
    tasks: dict[str, list[list[float]]] = {}
    for t in trajectories:
        if final(t):
            tasks.setdefault(str(t.task_id), []).append([t.reward, float(t.success)])
    return tasks


def result_text(results: dict) -> str:
    """The results as indented JSON, with each task's episodes on one line."""
    rest = {key: value for key, value in results.items() if key != "per_task"}
    tasks = ",\n".join(f"    {json.dumps(task)}: {json.dumps(value)}" for task, value in results["per_task"].items())
    return json.dumps(rest, indent=2)[:-2] + ',\n  "per_task": {\n' + tasks + "\n  }\n}\n"
