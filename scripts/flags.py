"""The table of train.py's main flags (docs/flags.md), its defaults column written from the code: the paper
preset's values and the tiny preset's (the default run's, on BabyAI), read off `train.parse_args`, so that the table
cannot go stale as the presets change. The rows (which flags, and what they mean) are the page's own.

    python scripts/flags.py            # prints the table as the code says it should be
    python scripts/flags.py --write    # and writes it into docs/flags.md

A value is shown as the flag takes it (on/off, a space between a tuple's values, 2e-4); 0 or None, where the
flag's docstring says what that means ("0: never", "default: the shipped train split"), as those words. A row's
cell is "paper / tiny" where the presets differ, one value list where they agree. tests/test_flags.py checks that
docs/flags.md holds what this prints.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import re
import sys
from dataclasses import fields, is_dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from rl.flags import flat  # noqa: E402

PAGE = ROOT / "docs" / "flags.md"
HEADER = "| flag | default (paper / tiny) | meaning |"


def docstrings(args=None) -> dict[str, str]:
    """Each flag's docstring (the string under its field in train.py's Args, or in its flag group's class, such as
    envs/guard.py's EnvArgs; a group made from a registry, rl/advantages.py's EstimatorArgs: its fields' tyro help),
    on one line."""
    args = train.Args() if args is None else args
    tree = ast.parse(Path(inspect.getsourcefile(type(args))).read_text())
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef)
                 and node.name == type(args).__name__), [])
    docs = {field.target.id: " ".join(doc.value.value.split()) for field, doc in zip(body, body[1:])
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}
    docs |= {f.name: marker.help for f in fields(args) for marker in getattr(f.type, "__metadata__", ())
             if getattr(marker, "help", None)}
    for f in fields(args):
        if is_dataclass(getattr(args, f.name)):
            docs |= docstrings(getattr(args, f.name))
    return docs


def shown(value, doc: str) -> str:
    """A default as the table shows it."""
    if value is None or value == () or (value == 0 and not isinstance(value, bool)):
        said = re.search(r"(?:default|(?<![\w.])0): ([^;,.(]+)", doc) if value in (None, ()) else re.search(r"(?<![\w.])0: ([^;,.(]+)", doc)
        return said.group(1).strip() if said else ("" if value in (None, ()) else "0")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return " ".join(f"{k} {v}" for k, v in value.items())
    if isinstance(value, float) and 0 < abs(value) < 1e-3:  # 2e-4, not 0.0002
        exponent = math.floor(math.log10(abs(value)))
        return f"{value / 10 ** exponent:g}e{exponent}"
    if isinstance(value, str) and Path(value).is_absolute():  # a shipped file: its path in the repo
        return Path(value).relative_to(ROOT).as_posix() if Path(value).is_relative_to(ROOT) else value
    return f"{value:g}" if isinstance(value, float) else str(value)


def defaults_cell(names: list[str], paper, tiny, docs: dict[str, str]) -> str:
    """The defaults of one row's flags: "paper / tiny", or one list where both presets agree."""
    sides = [[shown(flat(args)[name], docs.get(name, "")) for name in names] for args in (paper, tiny)]
    if not any(value for side in sides for value in side):
        return ""
    cells = [", ".join(value or "none" for value in side) for side in sides]
    return cells[0] if cells[0] == cells[1] else f"{cells[0]} / {cells[1]}"


def table(page: str) -> tuple[str, str]:
    """(The page's flag table as it is, as the code says it should be)."""
    lines = page.splitlines()
    start = lines.index(HEADER)
    end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))
    names = set(flat(train.Args()))
    # the presets as a user meets them: `--preset` itself as its flag's default, not the preset it resolved to
    paper = replace(train.parse_args(["--preset", "paper"]), preset=train.Args.preset)
    tiny = replace(train.parse_args([]), preset=train.Args.preset)
    docs = docstrings()
    rows = lines[start:start + 2]
    for line in lines[start + 2:end]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]  # (an escaped \| is in a cell)
        flags = [flag.replace("-", "_") for flag in re.findall(r"--([a-z0-9-]+)", cells[0])]
        unknown = [flag for flag in flags if flag not in names]
        if unknown:
            raise SystemExit(f"docs/flags.md's flag table names --{unknown[0].replace('_', '-')}, "
                             "which train.py's Args lacks")
        rows.append("| " + " | ".join([cells[0], defaults_cell(flags, paper, tiny, docs), *cells[2:]]).replace("  ", " ") + " |")
    return "\n".join(lines[start:end]), "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the table into docs/flags.md")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    old, new = table(page)
    print(new)
    if args.write and new != old:
        PAGE.write_text(page.replace(old, new))
        print(f"wrote {PAGE}", file=sys.stderr)


if __name__ == "__main__":
    main()
