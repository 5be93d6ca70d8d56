"""The docs against the code. Every command in README.md and docs/*.md (code blocks and inline code) parses: the flags
of train.py, eval.py and `accelerate launch ... train.py` with their own parsers, a script's or module's with its
argparse or tyro parser, nothing run; a module, script or config a command names exists. Every flag a docs table
names is one of train.py's or eval.py's, and a default the docs give right after a flag, `--flag` (N, ...), is the
code's (train.py's presets or eval.py's). docs/flags.md's table is written from the code (tests/test_flags.py)."""

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import re
import shlex
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:[A-Z_]+=\S+ )*(?:python|accelerate|bash) \S")
# what a reader replaces: an env's name, a loop's variable, any recipe; whole words: a seed, an env
PLACEHOLDERS = {"<name>": "babyai", "$seed": "1", "<recipe>": "*"}
PLACEHOLDER_WORDS = {"S": "1", "ENV": "babyai"}


def commands(text: str) -> list[str]:
    """The commands of a page: its shell code blocks' lines (a `$ ` prompt dropped, continued lines joined) and its
    inline code that is a command, each part between `;`, `&&`, `&` or `|` its own."""
    found, block, line_so_far = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            block = None if block is not None else line.lstrip()[3:].strip()
            continue
        if block in ("", "bash", "sh"):
            line = line_so_far + (line[2:] if line.startswith("$ ") else line).strip()
            line_so_far = line[:-1] + " " if line.endswith("\\") else ""
            if not line_so_far:
                found.append(line)
    prose = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    parts = [part.strip() for command in found for part in re.split(r";|&&|&(?=\s|$)|\||\bdo\b|\bdone\b", command)]
    return [part for part in parts if COMMAND.match(part)]


def words(command: str) -> list[str]:
    """A command's words as the shell gives them to the program: comments, leading VAR=value and `...` dropped."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    argv = [PLACEHOLDER_WORDS.get(word, word) for word in shlex.split(command, comments=True) if word != "..."]
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        argv.pop(0)
    return argv


DOC_COMMANDS = sorted({(page.name, command) for page in DOCS for command in commands(page.read_text())})


class Parsed(Exception):
    """Raised by the patched parser once a script's flags parsed: nothing of the script runs after it."""


def parse_script(module, argv: list[str], monkeypatch) -> None:
    """Parse `argv` with a script's own parser: its tyro Args or parse_args(argv), else its main(argv) stopped at
    argparse's parse_args; a script without a parser takes no flags. No flags at all: the prose names the script."""
    if not argv:
        return
    if hasattr(module, "Args") and "tyro.cli(Args" in inspect.getsource(module):
        module.tyro.cli(module.Args, args=argv)
        return
    if callable(getattr(module, "parse_args", None)):
        module.parse_args(argv)
        return
    main = getattr(module, "main", None)  # (maybe imported from where the script's code lives)
    if main is None or "ArgumentParser" not in inspect.getsource(main):
        assert not argv, f"{module.__name__} takes no flags, and the docs give it {argv}"
        return
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    with pytest.raises(Parsed):
        main(argv) if inspect.signature(main).parameters else main()


def eval_args(argv: list[str]):
    import eval as eval_script

    parse = getattr(eval_script, "parse_args", None)
    return parse(argv) if parse is not None else eval_script.tyro.cli(eval_script.Args, args=argv)


@pytest.mark.parametrize("page,command", DOC_COMMANDS, ids=[f"{page}:{command[:60]}" for page, command in DOC_COMMANDS])
def test_every_command_in_the_docs_parses(page, command, monkeypatch):
    argv = words(command)
    if argv[0] == "accelerate":
        assert argv[1] == "launch", command
        config = argv[argv.index("--config_file") + 1] if "--config_file" in argv else None
        assert config is None or (ROOT / config).is_file(), f"{config} does not exist"
        argv = ["python", *argv[next(i for i, word in enumerate(argv) if word.endswith(".py")):]]
    if argv[0] == "bash":
        assert list(ROOT.glob(argv[1])), f"{argv[1]} does not exist"
        return
    assert argv[0] == "python", command
    if argv[1] == "-m":
        module, rest = argv[2], argv[3:]
        top = module.split(".")[0]
        if not (ROOT / top).is_dir():  # another package's module (pytest, vLLM's server): installed, or nothing to check
            if importlib.util.find_spec(top) is None:
                pytest.skip(f"{top} is not installed here")
            return
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file() or (ROOT / module.replace(".", "/")).is_dir(), \
            f"no module {module}"
        parse_script(importlib.import_module(module), rest, monkeypatch)
        return
    script, rest = argv[1], argv[2:]
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if script in ("train.py", "eval.py"):
        try:
            train.parse_args(rest) if script == "train.py" else eval_args(rest)
        except SystemExit as stop:  # (--help)
            assert stop.code in (0, None), f"{command} does not parse"
    else:
        monkeypatch.syspath_prepend(str((ROOT / script).parent))
        spec = importlib.util.spec_from_file_location(f"docs_{Path(script).stem}", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up)
        spec.loader.exec_module(module)
        parse_script(module, rest, monkeypatch)


def test_the_docs_have_commands_of_every_kind():
    programs = {" ".join(words(command)[:2]) for _, command in DOC_COMMANDS}
    assert {"python train.py", "python eval.py", "accelerate launch", "python -m", "bash scripts/gpu_check.sh"} <= programs


def flags_of(parse) -> set[str]:
    """The flags a tyro parser takes, read off its --help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(["--help"])
    options = re.findall(r"^\W{0,4}((?:-\w, )?--[^ ]+(?: [^ ]+)*?)(?:  |$)", out.getvalue(), re.M)  # (the option column)
    return {flag for option in options for flag in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", option)}


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    flags = flags_of(train.parse_args) | flags_of(eval_args)
    return flags | {"--no-" + flag[2:] for flag in flags}


def table_rows() -> list[tuple[str, str]]:
    return [(page.name, line) for page in DOCS for line in page.read_text().splitlines() if line.startswith("|")]


def test_every_flag_a_table_names_is_train_or_evals(known_flags):
    unknown = []
    for page, row in table_rows():
        row = re.sub(r"`([^`]+)`", lambda span: "" if COMMAND.match(span.group(1)) else span.group(1), row)  # (commands: above)
        unknown += [(page, flag) for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", row) if flag not in known_flags]
    assert not unknown, unknown


def defaults(args) -> dict[str, object]:
    """Every field of a parsed Args, nested flag groups included, by name."""
    found = {}
    for field in fields(args):
        value = getattr(args, field.name)
        found.update(defaults(value) if is_dataclass(value) else {field.name: value})
    return found


def test_a_default_the_docs_give_after_a_flag_is_the_codes():
    sides = [defaults(train.parse_args([])), defaults(train.parse_args(["--preset", "paper"])), defaults(eval_args([]))]
    checked, wrong = 0, []
    for page in DOCS:
        for flag, value in re.findall(r"`--([a-z][a-z0-9-]*)` \((-?[0-9][0-9.e-]*)[,):\s]", page.read_text()):
            name = flag.replace("-", "_")
            given = [side[name] for side in sides if side.get(name) is not None]
            if not given:  # (a None default the code resolves later, e.g. --gamma by --algo)
                continue
            checked += 1
            if not any(isinstance(code, (int, float)) and float(value) == code for code in given):
                wrong.append((page.name, f"--{flag}", value, given))
    assert checked >= 5 and not wrong, wrong


# ---- the map: rl/__init__.py's and docs/architecture.md's, against the files and the code


def modules() -> list[Path]:
    """rl/'s modules and rl/engines/' (with its __init__.py, the engine contract): all but rl/__init__.py, the map."""
    return sorted(p for p in (ROOT / "rl").rglob("*.py") if p != ROOT / "rl" / "__init__.py")


def rows(page: str) -> list[tuple[list[str], str]]:
    """The "Who owns what" table's rows: (the files its first cell names, as paths; its second cell). A bare file
    name (`remote.py`) is in the folder of the path before it; a folder (`envs/`) stands for its modules."""
    found = []
    for first, second in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|$", page, re.M):
        files, folder = [], ""
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", first):  # (`envs/`: a folder's every module)
            if name.endswith("/"):
                files += [str(f.relative_to(ROOT)) for f in sorted((ROOT / name).rglob("*.py"))]
                continue
            folder = name.rpartition("/")[0] if "/" in name else folder
            files.append(name if "/" in name else f"{folder}/{name}".lstrip("/"))
        found.append((files, second))
    return found


def defined_names(paths, top: bool = False) -> set[str]:
    """The functions, classes (and their methods, unless `top`) and module-level names assigned in these files."""
    import ast

    names = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in tree.body if top else ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def code_files() -> list[Path]:
    return [*ROOT.glob("*.py"), *(ROOT / "rl").rglob("*.py"), *(ROOT / "envs").rglob("*.py")]


def test_every_rl_module_is_on_both_maps():
    """A module added to rl/ is listed in rl/__init__.py's map, by its file name, and named in docs/architecture.md."""
    import rl

    owned = {name for files, _ in rows((ROOT / "docs" / "architecture.md").read_text()) for name in files}
    for path in modules():
        listed = re.search(rf"(^\s+|\(){re.escape(path.name)}\b", rl.__doc__, re.M)
        assert listed, f"rl/__init__.py's map does not list {path.relative_to(ROOT)}"
        assert str(path.relative_to(ROOT)) in owned, f"docs/architecture.md has no row for {path.relative_to(ROOT)}"


def test_what_the_architecture_page_names_exists_where_it_says():
    """Every function or class the page names in code spans exists; a diagram line `name(...)  rl/x.py: ...` names a
    function of rl/x.py (or of the entry script that calls it); a row of "Who owns what" owns what it names (flag
    groups, which live next to the code that reads them, aside); the page holds no path of a developer's machine."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    everywhere = defined_names(code_files())
    spans = {m.group(1) for m in re.finditer(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\([^`]*\))?`", page)}
    code_like = {s for s in spans if "_" in s or re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", s)}
    assert not code_like - everywhere, f"docs/architecture.md names what the code lacks: {code_like - everywhere}"
    for line in page.splitlines():
        call = re.match(r"\s*(?:train\.py main ─ )?([a-z_]+)(?:\([^)]*\))?[\s─]+(rl/[\w/]+\.py):", line)
        if call:
            name, where = call.groups()
            assert name in defined_names([ROOT / where, ROOT / "train.py", ROOT / "rollout.py"]), (
                f"docs/architecture.md places {name} in {where}")
    top = defined_names(code_files(), top=True)
    for files, owns in rows(page):
        owners = [ROOT / f for f in files if (ROOT / f).is_file()]
        assert len(owners) == len(files), f"docs/architecture.md has a row for a file that is not there: {files}"
        scripts = any(f in ("train.py", "eval.py") for f in files)  # (whose rows name their flag groups, kept elsewhere)
        owned = {n for n in re.findall(r"`([A-Za-z_]\w*)`", owns) if n in top and not (scripts and n.endswith("Args"))}
        mine = defined_names(owners)
        assert owned <= mine, f"{files} do not own {owned - mine}"
    for page_path in DOCS:
        assert not re.search(r"(?<![\w.])/(?:work|home|root|Users)/", page_path.read_text()), (
            f"{page_path.name} holds a path of a developer's machine")
