"""The PNGs at the end of a run or an eval: scripts/plot.py, run as its own process, so that training and
eval never depend on matplotlib or on the plotting code (a failure is one line, never a lost run).

    draw(run_dir)              # -> run_dir/curves.png, or None with the reason printed
    draw(result_json)          # an eval result -> the same name, .png

AGENTGYM_RL_PLOTS=0 in the environment turns them off (the tests' many short runs do).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "plot.py"


def draw(path: Path, timeout: float = 120.0) -> Path | None:
    if os.environ.get("AGENTGYM_RL_PLOTS", "1") == "0":
        return None
    out = path.with_suffix(".png") if path.suffix == ".json" else path / "curves.png"
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--out", str(out)], capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"no plots: {error}")
        return None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"no plots ({SCRIPT.name} failed: {reason})")
        return None
    return out
