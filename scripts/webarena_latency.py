"""Measure the WebArena env's reset and step latencies on its pages and write them to envs/data/webarena_latency.json,
the data that envs/latency.py's `webarena` distribution is fitted to.

    python scripts/webarena_latency.py                       # 8 minutes of play, one env, then the fit
    python scripts/webarena_latency.py --seconds 60 --out /tmp/latency.json

One env on the local sites (the env's default here: a real Chromium on the shop, forum and homepage this process
serves, envs/webarena/sites.py) plays episodes one after another, as a rollout's env would between two model
turns: a third are the task's expert (envs.oracle), the rest random valid actions read off the observation
(clicks on links and buttons but not logouts, typing into text boxes with or without Enter, hovers, scrolls,
back, forward, a key), 1 to 12 of them, then `stop [...]`, which runs the task's evaluators. Tasks are drawn at
random from all the local tasks. Every reset and every step that reached the browser is timed (time.monotonic
around the call); answers that never touch the browser (no ``` block, an action that does not parse, a refused
goto) take microseconds and are not recorded. The first reset (Chromium's launch and the logins) is warm-up and
not recorded. One env at a time, so that the machine stays lightly loaded and a latency is the env's own, not a
queue behind other envs on the one browser thread. The machine's load average is recorded with the samples: on
a shared machine the latencies include waits for its cores.
"""

import argparse
import datetime
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import envs  # noqa: E402
from envs import latency  # noqa: E402
from envs.webarena import tasks  # noqa: E402

ELEMENT = re.compile(r"^\s*\[(\d+)\] (\w+) '(.*)'", re.MULTILINE)
CLICKABLE = ("link", "button", "checkbox", "radio", "menuitem", "tab", "option", "combobox")
TYPEABLE = ("textbox", "searchbox", "combobox", "spinbutton")
LOGOUTS = ("Sign Out", "Log out")
WORDS = ("headphones", "cable", "blender", "keyboard", "cooking", "2", "books", "Logitech", "great value")


def random_action(observation: str, rng: random.Random) -> str:
    """A valid action on the page the observation shows, drawn with rough weights of what an agent does."""
    elements = ELEMENT.findall(observation)
    # (never a logout: the env's next reset would log in anew, a cost the recorded samples were measured without)
    clickable = [i for i, role, name in elements if role in CLICKABLE and name not in LOGOUTS]
    typeable = [i for i, role, _ in elements if role in TYPEABLE]
    kind = rng.choices(["click", "type", "hover", "scroll", "go_back", "go_forward", "press"],
                       weights=[50, 12, 5, 15, 10, 3, 5])[0]
    if kind == "click" and clickable:
        return f"click [{rng.choice(clickable)}]"
    if kind == "type" and typeable:
        return f"type [{rng.choice(typeable)}] [{rng.choice(WORDS)}] [{rng.choice('01')}]"
    if kind == "hover" and elements:
        return f"hover [{rng.choice(elements)[0]}]"
    if kind == "go_back" or kind == "go_forward":
        return kind
    if kind == "press":
        return f"press [{rng.choice(['Enter', 'PageDown', 'End'])}]"
    return f"scroll [{rng.choice(['down', 'up'])}]"


def episode(env, task_id: int, rng: random.Random, samples: dict, kinds: dict) -> None:
    """Reset to `task_id` and play it to `stop`, timing the reset and every step."""
    started = time.monotonic()
    observation = env.reset(task_id)
    samples["reset"].append(time.monotonic() - started)
    expert = envs.oracle(env) if rng.random() < 1 / 3 else None
    actions = 100 if expert else rng.randint(1, 12)
    for turn in range(actions + 1):
        if expert:
            text = expert(observation)
        else:
            text = f"```{random_action(observation, rng) if turn < actions else 'stop [Done]'}```"
        started = time.monotonic()
        result = env.step(text)
        seconds = time.monotonic() - started
        if result.info.get("valid") and "refused" not in result.info:
            samples["step"].append(seconds)
            action = text.split("```")[1]
            enter = re.match(r"(type .*\[1\]|press \[Enter\])$", action)  # (waits up to 1 s for a navigation)
            kinds[action.split(" ")[0] + (" + Enter" if enter else "")].append(seconds)
        observation = result.observation
        if result.done:
            return


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=480.0, help="how long to play (after the warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="the tasks' and random actions' seed")
    parser.add_argument("--out", default=str(latency.DATA_FILE), help="where the samples go")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    task_ids = list(range(len(tasks.configs("local"))))

    load_before = os.getloadavg()
    env = envs.make("webarena", sites="local")
    env.reset(0)  # the warm-up: Chromium's launch and the logins
    samples, kinds, failed, played = {"reset": [], "step": []}, defaultdict(list), [], 0
    stop_at = time.monotonic() + args.seconds
    while time.monotonic() < stop_at:
        task_id = rng.choice(task_ids)
        try:
            episode(env, task_id, rng, samples, kinds)
        except Exception as error:  # a browser failure costs that episode; the next reset starts over
            failed.append(f"task {task_id}: {type(error).__name__}: {error}".splitlines()[0])
        played += 1
    env.close()

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip():
        commit += " with uncommitted changes"
    record = {
        "how": __doc__.split("\n\n", 2)[2].strip().replace("\n", " "),
        "command": "python scripts/webarena_latency.py " + " ".join(sys.argv[1:]),
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, "
                   f"{len(os.sched_getaffinity(0))} cores",
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "options": {"sites": "local", "settle_s": env.settle_s},
        "counts": {"episodes": played, "resets": len(samples["reset"]), "steps": len(samples["step"]),
                   "failed": len(failed)},
        "steps_by_action": {kind: {"count": len(seconds), "p50": round(statistics.median(seconds), 4),
                                   "max": round(max(seconds), 4)}
                            for kind, seconds in sorted(kinds.items(), key=lambda item: -len(item[1]))},
        "failures": failed,
        "reset_s": [round(s, 4) for s in samples["reset"]],
        "step_s": [round(s, 4) for s in samples["step"]],
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{played} episodes, {len(samples['reset'])} resets, {len(samples['step'])} steps, {len(failed)} failed; "
          f"-> {args.out}")
    print(json.dumps(record["steps_by_action"]))
    fitted = latency.fit_webarena(Path(args.out))
    for name, distribution in (("step", fitted.step), ("reset", fitted.reset)):
        print(compare(name, record[f"{name}_s"], distribution))


def compare(name: str, seconds: list[float], distribution: latency.Distribution) -> str:
    """The measured and the fitted p50, p90, p99 and max (fitted: the median of the largest of as many draws)."""
    ordered = sorted(seconds)
    measured = [ordered[math.ceil(p * len(ordered)) - 1] for p in (0.5, 0.9, 0.99)] + [ordered[-1]]
    fitted = [distribution.quantile(p) for p in (0.5, 0.9, 0.99, 0.5 ** (1 / len(ordered)))]
    return (f"{name}: {len(seconds)} calls, p50 / p90 / p99 / max measured "
            + " / ".join(f"{s:.3f}" for s in measured) + " s, fitted " + " / ".join(f"{s:.3f}" for s in fitted)
            + f" s; {distribution}")


if __name__ == "__main__":
    main()
