"""docs/bring-your-own-env.md against the code. Every example env on the page is a file of docs/examples/, quoted whole
(the page cannot drift from what runs), and every command the page gives runs, each route in a cheap form: train.py
for one step of 2 tasks x 2 samples, 2 turns of 16 tokens on the HF engine, eval.py on 2 tasks, the scripts on 2
tasks (8 expert episodes, SFT in batches of 2), an OpenEnv server on a free port, the native route's registry line as the page writes it. Also what the page
needed of the adapters: a plain class without close() plays, and an endless verifiers taskset's test rows are near."""

import contextlib
import json
import re
import shlex
import time
from pathlib import Path

import pytest

import envs
import eval as eval_script
import train
from test_docs import eval_args

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "bring-your-own-env.md"
EXAMPLES = ROOT / "docs" / "examples"
CHEAP_TRAIN = ["--engine", "hf", "--steps", "1", "--tasks-per-step", "2", "--n", "2", "--horizon", "2",
               "--max-new-tokens", "16", "--eval-every", "0"]
CHEAP_EVAL = ["--engine", "hf", "--limit", "2", "--k", "1"]


def page() -> str:
    return PAGE.read_text()


def quoted_files(text: str) -> dict[str, str]:
    """The page's quoted files: each ```python block right after a line `docs/examples/NAME.py`:, by that path."""
    lines, found = text.splitlines(), {}
    for i, line in enumerate(lines[:-1]):
        named = re.fullmatch(r"`(docs/examples/\w+\.py)`:", line.strip())
        if named and lines[i + 1] == "```python":
            end = lines.index("```", i + 2)
            found[named.group(1)] = "\n".join(lines[i + 2:end]) + "\n"
    return found


def sections(text: str) -> dict[str, list[str]]:
    """The commands of each `## ` section's ```bash blocks, in order (continued lines joined)."""
    found, section, block, so_far = {}, None, False, ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:]
            found[section] = []
        elif line.startswith("```"):
            block = line == "```bash"
        elif block and line.strip():
            so_far += line.strip()
            if so_far.endswith("\\"):
                so_far = so_far[:-1] + " "
            else:
                found[section].append(so_far)
                so_far = ""
    return {name: commands for name, commands in found.items() if commands}


def registry_line(text: str) -> str:
    [line] = [line.strip() for line in text.splitlines() if "Registration(" in line]
    return line


def route(title_start: str) -> list[str]:
    [commands] = [commands for title, commands in sections(page()).items() if title.startswith(title_start)]
    return commands


# ----------------------------------------------------------------------------------------------
# The page and its files


def test_the_page_quotes_every_example_file_whole():
    quoted = quoted_files(page())
    files = {str(path.relative_to(ROOT)): path.read_text() for path in EXAMPLES.glob("*.py")}
    assert quoted.keys() == files.keys()
    for path, text in files.items():
        assert quoted[path] == text, f"docs/bring-your-own-env.md's copy of {path} differs from the file"


def test_the_page_is_linked_and_gives_a_command_for_every_route():
    titles = [title for title in sections(page()) if title[0].isdigit()]  # (the routes; then what was measured)
    assert len(titles) == 5 and all(route(title) for title in titles)
    assert "bring-your-own-env.md" in (ROOT / "README.md").read_text()
    assert "bring-your-own-env.md" in (ROOT / "docs" / "environments.md").read_text()
    assert "pip install -r requirements-standards.txt" in page()


# ----------------------------------------------------------------------------------------------
# What the adapters do for the examples


def test_a_plain_class_plays_without_gymnasium_and_without_close():
    from docs.examples.maze import Maze

    assert not hasattr(Maze, "close") and not issubclass(Maze, __import__("gymnasium").Env)
    env = envs.make("gym:docs.examples.maze:Maze")
    first = env.reset(1000)
    assert first.startswith("The exit is in room (2, 2).") and env.instruction.startswith(Maze.metadata["description"])
    assert env.step("Action: up").info["valid"] is False  # (the game's info["valid"])
    env.close()


def test_an_endless_verifiers_taskset_tests_on_rows_an_env_reaches_at_once(monkeypatch):
    pytest.importorskip("verifiers", reason="the standards are optional: pip install -r requirements-standards.txt")
    monkeypatch.syspath_prepend(str(EXAMPLES))
    assert envs.splits("verifiers:maze_verifiers") == {"train": list(range(1000)), "test": list(range(1000, 1100))}
    env = envs.make("verifiers:maze_verifiers")
    start = time.perf_counter()
    assert env.reset(1099).startswith("The exit is in room (2, 2).")  # (it reads 1,100 rows to get there)
    assert time.perf_counter() - start < 10
    env.close()


def test_the_native_maze_gives_what_only_that_route_gives(monkeypatch):
    registered = native(monkeypatch)
    assert registered.upstream_horizon == 12
    env = envs.make("maze")
    result = envs.oracle_episode(env, 1003)
    assert result.done and result.reward == 1.0
    env.reset(1003)
    twin = env.fork()
    env.step(envs.oracle(env)(""))
    assert twin.state_key() == "(0, 0)" != env.state_key()
    assert {envs.category("maze", task) for task in envs.splits("maze")["test"]} == {"4 moves", "6 moves", "8 moves"}
    from envs.tools import action_text, schemas

    assert [tool["function"]["name"] for tool in schemas("maze")] == ["go"]
    assert action_text("maze", "go", {"door": "east"}) == "Action: east"


def native(monkeypatch) -> envs.Registration:
    """The page's registry line in envs.ENVS, its module the example the page says to copy to envs/maze.py."""
    [copy] = [command for command in route("5.") if command.startswith("cp ")]
    source, target = shlex.split(copy)[1:]
    assert (ROOT / source).is_file() and target == "envs/maze.py"
    line = registry_line(page())
    assert '"maze": Registration("envs.maze",' in line
    registration = eval("{" + line + "}", {"Registration": envs.Registration})["maze"]
    registration = envs.Registration(source[:-3].replace("/", "."), **{
        key: getattr(registration, key) for key in ("call_timeout", "upstream_horizon", "upstream_max_new_tokens")})
    monkeypatch.setitem(envs.ENVS, "maze", registration)
    return registration


# ----------------------------------------------------------------------------------------------
# Every command of the page, cheap


class Commands:
    """Runs a route's commands in process: paths under runs/ and data/ in a temporary folder, a checkpoint as the
    cheap run's last, a server the page starts on a free port (its URL replacing the page's)."""

    def __init__(self, tmp_path: Path, monkeypatch, stack: contextlib.ExitStack):
        self.tmp, self.monkeypatch, self.stack, self.urls, self.results = tmp_path, monkeypatch, stack, {}, []

    def word(self, word: str) -> str:
        for page_url, url in self.urls.items():
            word = word.replace(page_url, url)
        if word.startswith(("runs/", "data/")):
            word = str(self.tmp / word)
            checkpoint = re.fullmatch(r"(.*/checkpoints)/step_\d+", word)
            if checkpoint:
                steps = Path(checkpoint.group(1)).glob("step_*")
                word = str(max(steps, key=lambda step: int(step.name.split("_")[1])))
        return word

    def run(self, command: str):
        argv = shlex.split(command, comments=True)
        while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            assert name == "PYTHONPATH", command
            self.monkeypatch.syspath_prepend(str(ROOT / value))
        if argv[0] == "cp":
            return None  # (the native route's copy: native() registers the example where the copy would be)
        argv = [self.word(word) for word in argv]
        assert argv[0] == "python", command
        if argv[1:3] == ["-m", "uvicorn"]:
            from test_serve import serving_app

            module, _, name = argv[3].partition(":")
            app = getattr(__import__(module, fromlist=[name]), name)
            port = argv[argv.index("--port") + 1]
            self.urls[f"http://127.0.0.1:{port}"] = self.stack.enter_context(serving_app(app))
            return None
        if argv[1] == "train.py":
            cheap = CHEAP_TRAIN
            if "--epochs" in argv:  # (sft: as long as its epochs, over 8 expert episodes in batches of 2)
                at = CHEAP_TRAIN.index("--steps")
                cheap = [*CHEAP_TRAIN[:at], *CHEAP_TRAIN[at + 2:], "--batch-size", "2"]
            run_dir = train.main(train.parse_args([*argv[2:], *cheap, "--out-dir", str(self.tmp / "runs")]))
            rollouts = run_dir / "rollouts.jsonl"  # (none for sft)
            return [json.loads(line) for line in rollouts.read_text().splitlines()] if rollouts.exists() else run_dir
        if argv[1] == "eval.py":
            out = self.tmp / f"eval_{len(self.results)}"
            return eval_script.main(eval_args([*argv[2:], *CHEAP_EVAL, "--out", str(out)]))
        if argv[1] == "scripts/make_expert_data.py":
            from scripts.make_expert_data import main

            main([*argv[2:], "--limit", "8"])
            out = Path(argv[argv.index("--out") + 1])
            return [json.loads(line) for line in out.read_text().splitlines()]
        raise AssertionError(f"the test does not know how to run {command}")

    def all(self, commands: list[str]) -> list:
        for command in commands:
            self.results.append((command, self.run(command)))
        return self.results


@pytest.fixture
def commands(tmp_path, monkeypatch):
    with contextlib.ExitStack() as stack:
        yield Commands(tmp_path, monkeypatch, stack)


def check_played(results, spec: str) -> None:
    """Each train.py run played `spec` without an env error, and each eval.py scored 2 of its tasks without one."""
    trained = evaluated = 0
    for command, result in results:
        if "train.py" in command:
            assert result and all(r["error"] is None and r["item_id"].startswith(f"{spec}_") for r in result), command
            trained += 1
        elif "eval.py" in command:
            assert result["tasks"] == 2 and result["errors"] == 0, command
            evaluated += 1
    assert trained and evaluated


@pytest.mark.slow
def test_the_plain_class_route(commands):
    check_played(commands.all(route("1.")), "gym:docs.examples.maze:Maze")


@pytest.mark.slow
def test_the_gymnasium_route(commands):
    check_played(commands.all(route("2.")), "gym:docs.examples.maze_gymnasium:TextMaze-v0")


@pytest.mark.slow
def test_the_openenv_route_in_process_and_served(commands):
    pytest.importorskip("openenv", reason="the standards are optional: pip install -r requirements-standards.txt")
    results = commands.all(route("3."))
    local = [r for c, r in results if "train.py" in c and "openenv:docs" in c]
    served = [r for c, r in results if "train.py" in c and "openenv:http" in c]
    assert len(local) == len(served) == 1
    check_played([(c, r) for c, r in results if "openenv:docs" in c or "maze-openenv/" in c],
                 "openenv:docs.examples.maze_openenv.MazeEnvironment")
    [url] = commands.urls.values()
    check_played([(c, r) for c, r in results if "openenv:http" in c or "maze-served/" in c], f"openenv:{url}")


@pytest.mark.slow
def test_the_verifiers_route(commands):
    pytest.importorskip("verifiers", reason="the standards are optional: pip install -r requirements-standards.txt")
    check_played(commands.all(route("4.")), "verifiers:maze_verifiers")


@pytest.mark.slow
def test_the_native_route(commands, monkeypatch):
    native(monkeypatch)
    results = commands.all(route("5."))
    experts = [r for c, r in results if "make_expert_data" in c]
    assert experts and all(len(r) == 8 and all(e["reward"] == 1.0 for e in r) for r in experts)
    check_played([(c, r) for c, r in results if "--algo sft" not in c and "make_expert_data" not in c], "maze")
