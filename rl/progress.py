"""Progress on one line while episodes play: eval.py's bar, and train.py's step bar during a rollout, an update
and an evaluation.

    played, stop = play_until_stopped(partial(play, ...), "eval babyai", 8, horizon)   # a line of its own (eval.py)
    rollouts.take(step, Progress(bar, "rollout", 16, horizon))     # after train.py's step bar

A rollout with a real model can play for many minutes before its first episode ends (upstream's BabyAI eval: 20
turns of up to 512 tokens), so a count of episodes alone stands still; Progress also counts the turns played and
the tokens sampled, with their rate, and estimates the time left: the turns still to play at most (every episode
not yet ended runs to its turn cap) at the rate of turns so far. Early endings (the env's done, the token budget)
make the estimate fall as the run goes on.

On a terminal the line redraws in place; elsewhere (a log file, CI) it is written at most every NON_TTY_S seconds,
so a log gets a line now and then, not one per turn. Progress also keeps the episodes that ended, in the order
they ended: what eval.py writes when Ctrl-C stops it (finished).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, NoReturn

from tqdm import tqdm

from rl.trajectory import Trajectory

NON_TTY_S = 30.0
STOPPED = 130  # the exit status of a program stopped by Ctrl-C (128 + SIGINT), as a shell reports one


def progress_bar(**options) -> tqdm:
    """A tqdm bar that redraws itself at most every 0.1 s on a terminal, every NON_TTY_S seconds elsewhere."""
    return tqdm(mininterval=0.1 if sys.stderr.isatty() else NON_TTY_S, dynamic_ncols=True, **options)


def step_bar(first: int, last: int, shown: bool, desc: str = "train") -> tqdm:
    """train.py's bar over steps `first` to `last` (the steps before `first` done), drawn where `shown`."""
    return progress_bar(iterable=range(first, last + 1), disable=not shown, desc=desc, initial=first - 1, total=last)


def show(line: tqdm | None, text: str) -> None:
    """Put `text` after the bar `line` (None: nothing shown), drawn when the bar's mininterval has passed."""
    if line is None or line.disable:
        return
    line.set_postfix_str(text, refresh=False)
    now = time.time()
    # its own clock: tqdm's last_print_t belongs to its iterator, which counts the steps it has shown from it (set
    # here, the iterator added its steps again at its next redraw: "82it" at step 15 of 16)
    if now - getattr(line, "shown_at", 0.0) >= line.mininterval:
        line.refresh()
        line.shown_at = now


@dataclass(frozen=True)
class Played:
    """Counts over trajectories: those that ended, the turns played, the tokens sampled, and the turns the ended
    ones left unplayed below their turn cap."""

    ended: int = 0
    turns: int = 0
    tokens: int = 0
    unplayed: int = 0

    @staticmethod
    def of(trajectories) -> Played:
        ts = list(trajectories)
        return Played(sum(not t.live for t in ts), sum(t.turns for t in ts), sum(sampled(t) for t in ts),
                      sum(max(t.horizon - t.turns, 0) for t in ts if not t.live))

    def __add__(self, other: Played) -> Played:
        return Played(self.ended + other.ended, self.turns + other.turns, self.tokens + other.tokens,
                      self.unplayed + other.unplayed)


def sampled(t: Trajectory) -> int:
    """The tokens a trajectory's turns sampled (a text engine's: the server's count)."""
    return t.sampled + int(t.usage.get("completion_tokens", 0))


class Progress:
    """The progress callback of rollout(), play() and Rollouts.take: called with a set's trajectories whenever one
    of them moved, it shows "<name> ended/total episodes, turns, tokens (their rate), time left" on `line`.
    `total` episodes (reflect's attempts: `unit` "attempts", total the most there can be) of at most `horizon`
    turns each."""

    def __init__(self, line: tqdm | None, name: str, total: int, horizon: int, unit: str = "episodes"):
        self.line, self.name, self.total, self.horizon, self.unit = line, name, total, horizon, unit
        self.start = time.perf_counter()
        self.live: dict[int, Trajectory] = {}  # id -> a trajectory going on
        self.finished: list[Trajectory] = []  # the ended ones, in the order they were seen ended
        self.ended_ids: set[int] = set()
        self.done = Played()  # the ended ones' counts

    def __call__(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            if id(t) in self.ended_ids:
                continue
            if t.live:
                self.live[id(t)] = t
                continue
            self.live.pop(id(t), None)
            self.ended_ids.add(id(t))
            self.finished.append(t)
            self.done += Played.of([t])
        show(self.line, self.text())

    def counts(self) -> Played:
        return self.done + Played.of(self.live.values())

    def text(self) -> str:
        now, seconds = self.counts(), time.perf_counter() - self.start
        total = max(self.total, now.ended + len(self.live))  # (--dynamic-sampling's replays are episodes played too)
        text = (f"{self.name} " if self.name else "") + f"{now.ended}/{total} {self.unit}, {now.turns} turns"
        if now.tokens:
            text += f", {_count(now.tokens)} tokens ({now.tokens / max(seconds, 1e-9):.0f}/s)"
        if now.turns and now.ended < total:
            left = max(total * self.horizon - now.unplayed - now.turns, 0)
            text += f", ~{_duration(left * seconds / now.turns)} left"
        return text


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def phase(line: tqdm | None, name: str, total: int):
    """A progress callback for a phase of a step counted in units (an update's micro-batches), shown after the
    step bar `line` as "<name> done/total"."""
    done = 0

    def advance(count: int = 1) -> None:
        nonlocal done
        done += count
        show(line, f"{name} {done}/{total}")

    return advance


# ----------------------------------------------------------------------------------------------
# Ctrl-C


def play_until_stopped(play: Callable[..., list[Trajectory]], name: str, episodes: int, horizon: int,
                       attempts: int = 1) -> tuple[list[Trajectory], bool]:
    """`play(progress=...)` (rollout.play's episodes, `attempts` a task under reflect) on a line of its own named `name`:
    its trajectories and False, or when Ctrl-C stops it, the ones that had ended and True (nothing ended: it stops,
    with one line)."""
    with progress_bar(total=episodes, desc=name, bar_format="{desc}{postfix} [{elapsed}]") as line:
        progress = Progress(line, "", episodes * attempts, horizon, "attempts" if attempts > 1 else "episodes")
        try:
            return play(progress=progress), False
        except KeyboardInterrupt:
            pass
    if not progress.finished:
        stopped(f"stopped by Ctrl-C after {progress.counts().turns} turns, before any episode ended: nothing written")
    return progress.finished, True


def stopped(line: str) -> NoReturn:
    """End the program stopped by Ctrl-C: `line` on stderr, no traceback, exit status STOPPED."""
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(STOPPED)
