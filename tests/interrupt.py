"""eval.py or train.py, sent SIGINT (Ctrl-C) at a chosen moment: what tests/test_progress.py checks they do then.

    python tests/interrupt.py SCRIPT POINT N [the script's flags]

The script runs as from the command line (its __main__ block included); the process sends itself SIGINT at
the N-th call (counted in this process) of POINT:
    step        an env step (mid-rollout; env steps run in threads, and the signal reaches the main thread)
    checkpoint  a checkpoint's policy optimizer state, before it is written (mid-checkpoint)
"""

import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from envs.babyai import BabyAI  # noqa: E402
from rl import checkpoint as checkpoint_lib  # noqa: E402


def interrupt_at(owner, name: str, n: int) -> None:
    """Send SIGINT to this process at the n-th call of owner.name, before the call runs."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


if __name__ == "__main__":
    # Ctrl-C as at a terminal: SIGINT delivered, and raising KeyboardInterrupt. A test process's subprocess may
    # inherit SIGINT ignored or blocked from what ran in the test worker before (both survive exec), and Python then
    # installs no handler: the signal below would be lost and the script run to its end (exit 0, seen under xdist)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script, point, n, argv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    owner, name = {"step": (BabyAI, "step"), "checkpoint": (checkpoint_lib, "save_optimizer")}[point]
    interrupt_at(owner, name, n)
    sys.argv = [script, *argv]
    runpy.run_path(str(ROOT / script), run_name="__main__")
