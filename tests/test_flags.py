"""README's flag table: its defaults are what train.py's presets give (scripts/flags.py writes them)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_flag_table_is_what_the_presets_give():
    done = subprocess.run([sys.executable, "scripts/flags.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    readme = (ROOT / "README.md").read_text()
    table = done.stdout.strip()
    assert table in readme, ("README.md's flag table differs from the code's defaults; `python scripts/flags.py --write` "
                             "rewrites it:\n" + "\n".join(line for line in table.splitlines() if line not in readme))
