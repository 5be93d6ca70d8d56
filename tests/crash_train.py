"""train.py, killed with SIGKILL at a chosen moment: the crash that tests/test_resume.py recovers from.

    python tests/crash_train.py POINT N [train.py flags]

POINT is where the N-th call (counted in this process) dies:
    none        never: the run finishes
    rollout     an env step (mid-rollout)
    update      a micro-batch's forward and backward (mid-update)
    checkpoint  a checkpoint's policy optimizer state, after writing half of it (mid-checkpoint write)
    log         a log append, after writing half of its text (a torn line)
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402
from envs.babyai import BabyAI  # noqa: E402
from rl import checkpoint as checkpoint_lib  # noqa: E402
from rl.run import Logs  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(owner, name: str, n: int, half_file=None) -> None:
    """Make the n-th call of owner.name die: before the call, or after it with the file it wrote
    (half_file(args)) cut to half its length."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] < n:
            return original(*args, **kwargs)
        if half_file is None:
            die()
        original(*args, **kwargs)
        path = half_file(args)
        os.truncate(path, os.path.getsize(path) // 2)
        die()

    setattr(owner, name, wrapper)


def torn_append(n: int) -> None:
    original, calls = Logs._append, [0]

    def append(file, text):
        calls[0] += 1
        if calls[0] == n:
            file.write(text[:len(text) // 2])
            file.flush()
            os.fsync(file.fileno())
            die()
        original(file, text)

    Logs._append = staticmethod(append)


if __name__ == "__main__":
    point, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if point == "rollout":
        kill_at(BabyAI, "step", n)
    elif point == "update":
        kill_at(train, "update_policy", n)
    elif point == "checkpoint":
        kill_at(checkpoint_lib, "save_optimizer", n, half_file=lambda args: args[1])
    elif point == "log":
        torn_append(n)
    elif point != "none":
        raise SystemExit(f"unknown point {point!r}")
    train.main(train.parse_args(argv))
