"""The trajectory viewer: a local web page over what training and eval wrote, offline, down to the token the
optimiser was pushed on.

    python scripts/view.py runs/<run>                 # http://127.0.0.1:8000
    python scripts/view.py runs --port 8080           # every run under runs/ (and eval.py's results)
    ssh -L 8000:127.0.0.1:8000 gpu-box                # a run on another machine: forward the port, open it here

The page lists each run's training steps (reward, success, the horizon cap, from metrics.jsonl) and its
evaluations (step 0 is the initial policy; eval.py's results too); filters trajectories by env, category,
reward, success, task id, turns and finish reason, across every log or in one; replays a trajectory turn by
turn (instruction, each observation and action, the reward), with BabyAI's grid (MiniGrid's own rendering) or
TextCraft's goal and inventory at every turn; colours each token by loss mask, advantage, sampled log-prob or
the sampler-vs-trainer log-prob difference, with the exact token boundaries; and puts two trajectories of one
task side by side (two runs, two checkpoints, or step 0 against the last).

What it reads, and nothing else: under RUN_DIR every run's config.json and metrics.jsonl, every trajectory
log (rollouts.jsonl, evaluations.jsonl, failed_step_<k>.jsonl, eval.py's <result>.jsonl beside its .json)
in every log format so far (rl/records.py), its curves.png, and the run's tokenizer (a checkpoint's, else its
model's) to show token text. Logs are indexed as they grow, so a run still training can be watched; it never
writes anything. The env pictures come from replaying the logged actions on the in-process env, checked
observation by observation against the log (a replay that disagrees says so and stops drawing).

Safety: it binds 127.0.0.1 only. The API names logs by number, never by path; /files/ serves only regular
files whose real path (symlinks followed) lies under RUN_DIR, and refuses ../, encoded, absolute and
symlinked escapes with 403. The page is plain HTML and JavaScript (scripts/view.html) served from here: no
build step, no network, no dependency beyond the standard library, the envs and `tokenizers`.

Upstream (AgentGym's env-visualization) replays episodes against live env servers and cannot open a
training log; this opens logs, offline, and adds the token view and the comparison.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from rl.chat import CUT_MARK  # noqa: E402
from rl.context import with_request  # noqa: E402
from rl.records import action_positions, decode_array, read_metrics  # noqa: E402

PAGE = Path(__file__).with_name("view.html")
# the fields a listing needs; a record holds them before its messages (rl/records.py), so they are read
# without parsing the rest of a long line
SUMMARY = ("step", "item_id", "task_id", "category", "group", "horizon", "reward", "success", "turns", "finish",
           "error", "invalid_actions", "malformed", "tokens", "action_tokens", "segments", "turn_sequences", "attempt",
           "reflection")
TRAJECTORY_LOGS = ("rollouts.jsonl", "evaluations.jsonl")
ROW_LIMIT = 500  # rows a listing returns at most (the page pages through the rest)


# ----------------------------------------------------------------------------------------------
# Trajectory logs, indexed as they grow


def task_of(item_id: str) -> tuple[str, int | None]:
    """AgentGym's item id `<env>_<task id>` as (env, task id)."""
    env, _, number = item_id.rpartition("_")
    return (env, int(number)) if env and number.isdigit() else (item_id, None)


def summary(line: bytes) -> dict:
    """A record's outcome fields, with what older logs lack filled in (env, task id, category)."""
    head = line.split(b', "messages": ', 1)[0]
    try:
        record = json.loads(head + b"}") if head != line else json.loads(line)
    except json.JSONDecodeError:
        record = json.loads(line)  # written with other separators: parse it whole
    row = {key: record.get(key) for key in SUMMARY}
    row["env"], task_id = task_of(str(row["item_id"]))
    if row["task_id"] is None:
        row["task_id"] = task_id
    if row["category"] is None and task_id is not None and envs.known(row["env"]):
        try:
            row["category"] = envs.category(row["env"], task_id)
        except (ValueError, LookupError):  # (an env unknown here, or a spec whose package is missing)
            pass
    return row


class Log:
    """One JSONL file of trajectory records: each complete line's byte offset and summary, extended when the
    file grows (a run still writing), rebuilt when it shrinks (a resume cut it back to its checkpoint)."""

    def __init__(self, number: int, path: Path, run: str, kind: str, label: str):
        self.number, self.path, self.run, self.kind, self.label = number, path, run, kind, label
        self.offsets: list[int] = []
        self.rows: list[dict] = []
        self.size = 0
        self.lock = threading.Lock()

    def refresh(self) -> None:
        with self.lock:
            size = self.path.stat().st_size if self.path.is_file() else 0
            if size < self.size:
                self.offsets, self.rows, self.size = [], [], 0
            if size == self.size:
                return
            with open(self.path, "rb") as file:
                file.seek(self.size)
                data = file.read(size - self.size)
            position = self.size
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break  # a line still being written: taken in by a later refresh
                try:
                    row = summary(line)
                except (json.JSONDecodeError, TypeError, ValueError):
                    row = None  # a line torn by a crash: skipped, as train.py's resume skips it
                if row is not None:
                    self.offsets.append(position)
                    self.rows.append(row | {"log": self.number, "line": len(self.rows)})
                position += len(line)
            self.size = position

    def record(self, line: int) -> dict:
        with self.lock:
            offset = self.offsets[line]
        with open(self.path, "rb") as file:
            file.seek(offset)
            return json.loads(file.readline())

    def describe(self) -> dict:
        return {"log": self.number, "run": self.run, "kind": self.kind, "label": self.label,
                "path": self.path.name, "episodes": len(self.rows)}


# ----------------------------------------------------------------------------------------------
# Runs: what lies under the directory the viewer was given


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_run(directory: Path) -> bool:
    """A directory train.py wrote: its metrics, or its config (a checkpoint's config.json is the model's)."""
    return (directory / "metrics.jsonl").is_file() or "algo" in (read_json(directory / "config.json") or {})


class Runs:
    """Every run (a directory train.py wrote: is_run) and trajectory log under `root`; found again
    on every listing, so runs and evaluations that appear while the viewer is open show up."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.logs: list[Log] = []
        self.by_path: dict[Path, Log] = {}
        self.tokenizers: dict[str, object] = {}
        self.states: dict[tuple[int, int], dict] = {}
        self.lock = threading.Lock()

    def inside(self, path: Path) -> bool:
        """Whether a path's real location (symlinks followed) lies under the root."""
        try:
            return path.resolve().is_relative_to(self.root)
        except (OSError, RuntimeError):
            return False

    def run_name(self, directory: Path) -> str:
        relative = directory.relative_to(self.root).as_posix()
        return self.root.name if relative == "." else relative

    def scan(self) -> list[dict]:
        runs = []
        for directory, subdirs, files in os.walk(self.root):  # symlinked directories are not followed
            here = Path(directory)
            subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "superseded_")) and d != "wandb")
            if is_run(here):
                runs.append(self.run_entry(here, files))
            for name in sorted(files):  # eval.py's episodes: <result>.jsonl beside its <result>.json
                if name.endswith(".jsonl") and name[:-1] in files and name not in TRAJECTORY_LOGS:
                    result = read_json(here / name[:-1]) or {}
                    if "avg@k" in result:
                        self.log(here / name, self.run_name(self.owner(here)), "eval", eval_label(name, result))
        return runs

    def owner(self, directory: Path) -> Path:
        """The run a file belongs to: the nearest directory up to the root with a config.json, else its own."""
        for parent in [directory, *directory.parents]:
            if is_run(parent):
                return parent
            if parent == self.root:
                break
        return directory

    def run_entry(self, here: Path, files: list[str]) -> dict:
        name = self.run_name(here)
        if "rollouts.jsonl" in files:
            self.log(here / "rollouts.jsonl", name, "train", "training rollouts")
        if "evaluations.jsonl" in files:
            self.log(here / "evaluations.jsonl", name, "evaluations", "evaluations during training")
        for file in sorted(f for f in files if f.startswith("failed_step_") and f.endswith(".jsonl")):
            self.log(here / file, name, "failed", f"failed step {file[len('failed_step_'):-len('.jsonl')]}")
        config = read_json(here / "config.json") or {}
        metrics = read_metrics(here / "metrics.jsonl") if (here / "metrics.jsonl").is_file() else []
        return {"name": name, "config": {key: config.get(key) for key in ("env", "model", "algo", "horizon",
                                                                          "horizon_every", "env_limits", "steps", "n",
                                                                          "tasks_per_step")},
                "curves": (here / "curves.png").relative_to(self.root).as_posix() if (here / "curves.png").is_file() else None,
                "steps": training_steps(metrics), "evaluations": evaluation_steps(metrics)}

    def log(self, path: Path, run: str, kind: str, label: str) -> None:
        if not self.inside(path) or not path.is_file():
            return
        with self.lock:
            if path not in self.by_path:
                self.by_path[path] = Log(len(self.logs), path, run, kind, label)
                self.logs.append(self.by_path[path])

    def tokenizer_source(self, path: Path) -> str | None:
        """Where a log's token ids can be read back: the checkpoint an eval result sits in, a checkpoint of its
        run (any holds the run's tokenizer), else the model its eval result or its run names."""
        run = self.owner(path.parent)
        for directory in (path.parent, run):
            if (directory / "tokenizer.json").is_file():
                return str(directory)
            checkpoints = sorted(directory.glob("checkpoints/step_*/tokenizer.json"))
            if checkpoints:
                return str(checkpoints[-1].parent)
        named = read_json(path.with_suffix(".json")) or read_json(run / "config.json") or {}
        return named.get("model")

    def get(self, number) -> Log:
        try:
            return self.logs[int(number)]
        except (ValueError, TypeError, IndexError):
            raise NotFound(f"no trajectory log {number!r}") from None

    def tokenizer(self, log: Log):
        """The tokenizer of the run (or eval) a log belongs to, or None when none can be found offline."""
        model = self.tokenizer_source(log.path)
        if model not in self.tokenizers:
            self.tokenizers[model] = load_tokenizer(model)
        return self.tokenizers[model]


def eval_label(name: str, result: dict) -> str:
    return (f"eval {Path(name).stem}: {result.get('env', '?')} {result.get('split', '')}, k={result.get('k', '?')}, "
            f"{result.get('horizon', '?')} turns, Avg@k {result.get('avg@k', float('nan')):.3f}")


def training_steps(metrics: list[dict]) -> list[dict]:
    """Each training step's outcome as metrics.jsonl logged it (also for steps whose trajectories were not
    logged, --log-rollouts-every)."""
    return [{"step": m["charts/step"], "reward": m["rollout/reward"], "success": m.get("rollout/success"),
             "turns": m.get("rollout/turns"), "horizon": m.get("rollout/horizon"), "kl": m.get("losses/kl")}
            for m in metrics if "rollout/reward" in m and "charts/step" in m]


def evaluation_steps(metrics: list[dict]) -> list[dict]:
    return [{"step": m["charts/step"], "success": m.get("eval/success"), "avg": m.get("eval/avg@k"),
             "pass": m.get("eval/pass@k"), "horizon": m.get("eval/horizon")}
            for m in metrics if "eval/success" in m and "charts/step" in m]


# ----------------------------------------------------------------------------------------------
# Tokens: exact boundaries and what the update saw at each


def load_tokenizer(model: str | None):
    """A `tokenizers.Tokenizer` for a model directory, the embedded model or a hub id already in the cache."""
    if model is None:
        return None
    from tokenizers import Tokenizer

    directory = Path(model)
    if not directory.is_dir():
        from rl.model import EMBEDDED  # (imports torch: only for a run whose checkpoints are gone)

        directory = EMBEDDED.get(model, directory)
    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    try:  # a hub id: its cached files only, never a download
        from huggingface_hub import hf_hub_download

        return Tokenizer.from_file(hf_hub_download(model, "tokenizer.json", local_files_only=True))
    except Exception:  # noqa: BLE001 - no tokenizer: the token view shows ids
        return None


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text, as a streaming detokenizer shows it: the pieces join into the whole decoded
    trajectory. A character whose bytes span several tokens belongs to the token that finishes it; the tokens
    before show nothing (the view marks them by id). Each piece is decoded after its neighbour, so a tokenizer
    that drops a leading space at the start of a decode (SentencePiece) keeps it inside the trajectory."""
    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=False)

    pieces: list[str] = []
    prefix = shown = 0  # ids[prefix:shown]: the context decoded before the pending tokens ids[shown:]
    for k in range(len(ids)):
        before, text = decode(ids[prefix:shown]), decode(ids[prefix:k + 1])
        # an unfinished character waits for the next token, for at most the 4 bytes a character has
        if text.endswith("\ufffd") and k + 1 < len(ids) and k + 1 - shown < 4:
            pieces.append("")
            continue
        pieces.append(text[len(before):] if text.startswith(before) else text)
        prefix, shown = shown, k + 1
    whole = decode(ids)
    return pieces if "".join(pieces) == whole else _rejoin(pieces, whole)


def _rejoin(pieces: list[str], whole: str) -> list[str]:
    """The pieces made to join into `whole`, where a decoder is not local (SentencePiece's byte fallback turns a whole
    run of byte tokens to U+FFFD when one of them is bad): a piece that `whole` does not go on with shows nothing, and
    the text it skipped goes to the last such token (else the token before), once a later piece is found again."""
    out: list[str] = []
    at, owed = 0, None  # at: where `whole` goes on; owed: the last token whose piece did not match
    for piece in pieces:
        if whole.startswith(piece, at):
            out.append(piece)
            at += len(piece)
            continue
        found = whole.find(piece, at)
        if found < 0:
            out.append("")
            owed = len(out) - 1
            continue
        skipped, at, owed_before = whole[at:found], found + len(piece), owed
        if owed_before is not None or out:
            out[owed_before if owed_before is not None else -1] += skipped
        else:  # (the first token: the skipped text is its own)
            piece = skipped + piece
        out.append(piece)
        owed = None
    if at < len(whole):
        out[owed if owed is not None else -1] += whole[at:]
    return out


def per_token(value, positions: list[int], length: int) -> list[float | None] | None:
    """A per-action-token array (or one number for all of them) spread over the trajectory's positions."""
    values = decode_array(value)
    if values is None:
        return None
    if len(values) == 1 and len(positions) != 1:
        values = values * len(positions)
    out: list[float | None] = [None] * length
    for position, number in zip(positions, values):
        out[position] = None if number is None or math.isnan(number) else number
    return out


def token_view(record: dict, tokenizer) -> dict:
    """The trajectory's tokens with their loss mask and, at the action tokens, what the sampler and the update
    saw; a reason instead where the log predates token logging or the episode has no tokens (an API model's)."""
    if "token_ids" not in record:
        return {"reason": "this log was written before token ids were logged (log format 0): messages only"}
    if "usage" in record and not decode_array(record["token_ids"]):
        return {"reason": "a model behind an API (eval.py --model openai:<name>) gives text, no token ids: messages only"}
    ids = decode_array(record["token_ids"])
    spans = record.get("action_spans") or []
    positions = action_positions(spans)
    mask = [0] * len(ids)
    for position in positions:
        mask[position] = 1
    view = {"ids": ids, "mask": mask, "spans": spans,
            "text": token_texts(tokenizer, ids) if tokenizer is not None else None,
            "reason": None if tokenizer is not None else "no tokenizer found for this run: token ids shown"}
    for key, name in (("sampled_logprobs", "sampled"), ("trainer_logprobs", "trainer"), ("advantages", "advantage"),
                      ("values", "value"), ("returns", "return")):
        view[name] = per_token(record.get(key), positions, len(ids))
    return view


# ----------------------------------------------------------------------------------------------
# Env state: the logged actions replayed on the in-process env, checked against the logged observations


def replay(record: dict, options: dict) -> dict:
    """BabyAI's grid or TextCraft's goal and inventory after the reset and after every turn, each with the
    reward the env gave that turn and whether it took the action as valid; `diverged` is the first turn whose replayed observation differs from the
    log's (no state is drawn from there on)."""
    env_name, task_id = task_of(record["item_id"])
    if env_name not in ("babyai", "textcraft") or task_id is None:
        return {"kind": None}
    observations = env_answers(record)
    # what each turn sent to the env (after a reasoning block, a tool call's action; None: a reply answered without
    # the env); a log from before env_actions were recorded: the replies themselves
    actions = record.get("env_actions") or [m["content"] for m in record["messages"][3::2]]
    env = envs.make(env_name, **options)
    states, diverged = [], None
    try:
        observation, reward, valid = env.reset(task_id), None, None
        for turn, logged in enumerate(observations):
            if not same_answer(observation, logged):
                diverged = turn
                break
            states.append(picture(env) | {"turn": turn, "reward": reward, "valid": valid})
            if turn < len(actions) and actions[turn] is None:  # (the env never saw this reply: nothing changed)
                observation, valid = observations[turn + 1] if turn + 1 < len(observations) else None, False
            elif turn < len(actions):
                result = env.step(actions[turn])
                observation, reward, valid = result.observation, result.reward, result.info.get("valid")
    finally:
        env.close()
    return {"kind": env_name, "states": states, "diverged": diverged}


def env_answers(record: dict) -> list[str]:
    """The env's answers as the log holds them: the first observation, then its answer to each turn it read (a summary
    turn, --context summary:M, had none), without the summary request that came with some."""
    messages, summaries = record["messages"], set(record.get("summary_spans", []))
    answers, at, sample = [messages[2]["content"]] if len(messages) > 2 else [], 3, 0
    while at < len(messages):  # (each sampled turn's message, then the env's answer unless it was a summary)
        if sample not in summaries and at + 1 < len(messages):
            answers.append(messages[at + 1]["content"])
        at, sample = at + (1 if sample in summaries else 2), sample + 1
    request = with_request("")
    return [a[:-len(request)] if a.endswith(request) else a for a in answers]


def same_answer(observation: str, logged: str) -> bool:
    """The replayed observation is the logged one: equal, or (--max-obs-tokens) its head and tail around the cut."""
    mark = CUT_MARK.search(logged)
    if mark is None:
        return observation == logged
    head, tail = logged[:mark.start()], logged[mark.end():]
    return len(observation) > len(head) + len(tail) and observation.startswith(head) and observation.endswith(tail)


def picture(env) -> dict:
    if env.name == "babyai":
        from envs.babyai import picture as grid

        return {"image": "data:image/png;base64," + base64.b64encode(grid(env)).decode("ascii")}
    return {"goal": env.goal, "inventory": dict(env.inventory)}


# ----------------------------------------------------------------------------------------------
# The API


class NotFound(Exception):
    pass


class BadRequest(Exception):
    pass


def number(query: dict, key: str, default=None, kind=float):
    value = query.get(key, [""])[0]
    if value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise BadRequest(f"{key} must be a number, not {value!r}") from None


def matches(row: dict, query: dict) -> bool:
    """Whether a row passes the page's filters (each empty filter passes everything)."""
    for key in ("env", "category", "finish"):
        wanted = query.get(key, [""])[0]
        if wanted and str(row.get(key)) != wanted:
            return False
    success = query.get("success", [""])[0]
    if success and bool(row.get("success")) != (success == "yes"):
        return False
    task = query.get("task", [""])[0].strip()
    if task and task not in (str(row.get("task_id")), str(row.get("item_id"))):
        return False
    bounds = (("reward", "min_reward", "max_reward"), ("turns", "min_turns", "max_turns"), ("step", "min_step", "max_step"))
    for key, low, high in bounds:
        value, lo, hi = row.get(key), number(query, low), number(query, high)
        if (lo is not None or hi is not None) and value is None:
            return False
        if lo is not None and value < lo or hi is not None and value > hi:
            return False
    return True


def selected(runs: Runs, query: dict) -> list[Log]:
    wanted = query.get("log", ["all"])[0]
    logs = runs.logs if wanted == "all" else [runs.get(n) for n in wanted.split(",")]
    for log in logs:
        log.refresh()
    return logs


def api_runs(runs: Runs, query: dict) -> dict:
    found = runs.scan()
    for log in runs.logs:
        log.refresh()
    return {"root": str(runs.root), "runs": found, "logs": [log.describe() for log in runs.logs]}


def api_trajectories(runs: Runs, query: dict) -> dict:
    logs = selected(runs, query)
    rows = [row for log in logs for row in log.rows]
    facets = {key: sorted({str(row[key]) for row in rows if row.get(key) is not None}) for key in ("env", "category", "finish")}
    kept = [row for row in rows if matches(row, query)]
    offset = number(query, "offset", 0, int)
    return {"total": len(kept), "offset": offset, "rows": kept[offset:offset + ROW_LIMIT], "facets": facets}


def api_trajectory(runs: Runs, query: dict) -> dict:
    log = runs.get(query.get("log", [""])[0])
    log.refresh()
    line = number(query, "line", None, int)
    if line is None or not 0 <= line < len(log.rows):
        raise NotFound(f"{log.path.name} has no trajectory {line}")
    record = log.record(line)
    return {"summary": log.rows[line] | {"source": log.describe()}, "messages": record.get("messages", []),
            "tokens": token_view(record, runs.tokenizer(log))}


def api_state(runs: Runs, query: dict) -> dict:
    log = runs.get(query.get("log", [""])[0])
    line = number(query, "line", None, int)
    log.refresh()
    if line is None or not 0 <= line < len(log.rows):
        raise NotFound(f"{log.path.name} has no trajectory {line}")
    key = (log.number, line)
    if key not in runs.states:
        config = read_json(runs.owner(log.path.parent) / "config.json") or {}
        run_envs = [config["env"]] if isinstance(config.get("env"), str) else config.get("env") or []
        env = log.rows[line]["env"]
        options = envs.parse_options(envs.own_options(config.get("env_options") or {}, env)) if env in run_envs else {}
        runs.states[key] = replay(log.record(line), options)
    return runs.states[key]


def api_same_task(runs: Runs, query: dict) -> dict:
    item_id = query.get("item_id", [""])[0]
    for log in runs.logs:
        log.refresh()
    rows = [row | {"label": log.label, "run": log.run} for log in runs.logs for row in log.rows if row["item_id"] == item_id]
    return {"item_id": item_id, "rows": rows[:ROW_LIMIT], "total": len(rows)}


ROUTES = {"/api/runs": api_runs, "/api/trajectories": api_trajectories, "/api/trajectory": api_trajectory,
          "/api/state": api_state, "/api/same-task": api_same_task}
TYPES = {".png": "image/png", ".json": "application/json", ".jsonl": "application/json", ".txt": "text/plain"}


def run_file(runs: Runs, relative: str) -> Path:
    """A file under the root, or PermissionError for any path that would leave it."""
    relative = unquote(relative)
    if not relative or "\x00" in relative or relative.startswith(("/", "\\")) or ":" in relative.split("/")[0]:
        raise PermissionError(relative)
    path = runs.root / relative
    if not runs.inside(path):
        raise PermissionError(relative)
    if not path.resolve().is_file():
        raise NotFound(f"no file {relative}")
    return path.resolve()


def make_handler(runs: Runs):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlsplit(self.path)
            try:
                if url.path in ("/", "/index.html"):
                    self.send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
                elif url.path in ROUTES:
                    body = ROUTES[url.path](runs, parse_qs(url.query))
                    self.send(200, json.dumps(body, allow_nan=False, default=str).encode(), "application/json")
                elif url.path.startswith("/files/"):
                    path = run_file(runs, url.path[len("/files/"):])
                    self.send(200, path.read_bytes(), TYPES.get(path.suffix, "application/octet-stream"))
                else:
                    raise NotFound(f"no page {url.path}")
            except PermissionError:
                self.error(403, "refused: only files under the run directory are served")
            except NotFound as error:
                self.error(404, str(error))
            except BadRequest as error:
                self.error(400, str(error))
            except Exception as error:  # noqa: BLE001 - one bad log or request is an answer, never a dead server
                self.error(500, f"{type(error).__name__}: {error}")

        def error(self, status: int, message: str) -> None:
            self.send(status, json.dumps({"error": message}).encode(), "application/json")

        def send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # only failures reach the console
            if args and str(args[1])[:1] in "45":
                sys.stderr.write(f"view: {self.command} {self.path} -> {args[1]}\n")

    return Handler


def serve(root: Path, port: int) -> ThreadingHTTPServer:
    """The viewer's server on 127.0.0.1 (port 0: any free one), not yet serving."""
    runs = Runs(root)
    runs.scan()
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(runs))
    server.daemon_threads = True
    return server


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (runs/<run>) or a directory of runs (runs/)")
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free one)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise SystemExit(f"{args.run_dir} is not a directory: give a run directory (runs/<run>) or runs/")
    try:
        server = serve(args.run_dir, args.port)
    except OSError as error:
        raise SystemExit(f"cannot listen on 127.0.0.1:{args.port}: {error.strerror}; pick another --port") from None
    print(f"viewing {args.run_dir} at http://127.0.0.1:{server.server_address[1]}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
