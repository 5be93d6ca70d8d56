"""SearchQA questions: task id -> (question, golden answers, category).

Two id spaces, disjoint, so one `category(task_id)` serves both:

- AgentGym's global ids for the real QA sets (Search-R1's data, built from RUC-NLPIR/FlashRAG_datasets):
  test 0-51,712 (NQ, TriviaQA, PopQA, HotpotQA, 2WikiMultihopQA, MuSiQue, Bamboogle), train
  51,713-221,327 (NQ, HotpotQA). They need `qa_path=`, either
    * a FlashRAG_datasets folder: `<dataset>/<split>.jsonl` (or .parquet) with `question` and
      `golden_answers`; for the test ranges upstream took each dataset's test split, else dev,
      else train, and for the train ranges the train split; or
    * a folder with upstream's merged `test.parquet` and `train.parquet` (or `.jsonl`), in id order.
  Each file must have exactly the rows its id range expects, else it is not the file upstream used.
- The embedded default (ids from EMBEDDED_BASE = 1,000,000): `envs/data/searchqa/qa.jsonl`, built by
  scripts/searchqa_build_data.py from WordNet, GNU miscfiles and the Elements database. Row r has id
  1,000,000 + r; its `split` says train or test (test rows come first, as in AgentGym) and its
  `category` is the question template. Rows also carry `hops`, the searches a scripted expert makes.

As upstream's data script does, a question is stripped and gets a "?" if it has none.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "searchqa"
EMBEDDED_QA = DATA_DIR / "qa.jsonl"
EMBEDDED_CORPUS = DATA_DIR / "corpus.jsonl"
EMBEDDED_BASE = 1_000_000

# AgentGym's agentenv_searchqa ranges, [start, end) in global ids.
TEST_RANGES = {
    "nq": (0, 3610),
    "triviaqa": (3610, 14923),
    "popqa": (14923, 29190),
    "hotpotqa": (29190, 36595),
    "2wikimultihopqa": (36595, 49171),
    "musique": (49171, 51588),
    "bamboogle": (51588, 51713),
}
TRAIN_RANGES = {
    "nq": (51713, 130881),
    "hotpotqa": (130881, 221328),
}
SPLIT_RANGES = {"test": (0, 51713), "train": (51713, 221328)}


@dataclass
class Task:
    question: str
    golden_answers: list[str]
    category: str
    hops: list[dict] = field(default_factory=list)  # [{"search": query, "find": text}], embedded set only


def _range_of(task_id: int) -> tuple[str, str, int, int]:
    """(split, dataset, start, end) of a real-data id."""
    for split, ranges in (("test", TEST_RANGES), ("train", TRAIN_RANGES)):
        for dataset, (start, end) in ranges.items():
            if start <= task_id < end:
                return split, dataset, start, end
    raise ValueError(f"searchqa task id {task_id} is outside AgentGym's ranges (0-221327) and below the "
                     f"embedded set's ids (from {EMBEDDED_BASE})")


def category(task_id: int) -> str:
    task_id = int(task_id)
    if task_id >= EMBEDDED_BASE:
        return embedded_task(task_id).category
    return _range_of(task_id)[1]


def _question(text: str) -> str:
    text = str(text).strip()
    return text if text.endswith("?") else text + "?"


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to jsonl)") from error
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _answers(row: dict) -> list[str]:
    answers = row.get("golden_answers")
    if answers is None:  # upstream's merged files also keep them as reward_model.ground_truth.target
        answers = row["reward_model"]["ground_truth"]["target"]
    return [answers] if isinstance(answers, str) else [str(a) for a in answers]


# ----------------------------------------------------------------------------------------------
# The embedded default

_EMBEDDED: list[Task] | None = None
_LOCK = threading.Lock()


def embedded_tasks() -> list[Task]:
    global _EMBEDDED
    with _LOCK:
        if _EMBEDDED is None:
            rows = _read_rows(EMBEDDED_QA)
            for r, row in enumerate(rows):
                assert row["id"] == EMBEDDED_BASE + r, f"{EMBEDDED_QA} row {r} has id {row['id']}"
            _EMBEDDED = [Task(_question(row["question"]), _answers(row), row["category"], row["hops"]) for row in rows]
        return _EMBEDDED


def embedded_task(task_id: int) -> Task:
    tasks = embedded_tasks()
    if not EMBEDDED_BASE <= task_id < EMBEDDED_BASE + len(tasks):
        raise ValueError(f"searchqa task id {task_id} is not in the embedded set "
                         f"({EMBEDDED_BASE}-{EMBEDDED_BASE + len(tasks) - 1})")
    return tasks[task_id - EMBEDDED_BASE]


# ----------------------------------------------------------------------------------------------
# AgentGym's real QA sets


class RealQA:
    """Rows of the real QA sets, loaded lazily one file at a time and shared across env instances."""

    def __init__(self, qa_path: str | Path):
        self.root = Path(qa_path).expanduser()
        if not self.root.is_dir():
            raise FileNotFoundError(f"qa_path {self.root} is not a folder; pass the FlashRAG_datasets folder "
                                    "(nq/test.jsonl, hotpotqa/dev.jsonl, ...) or one with upstream's merged "
                                    "test.parquet and train.parquet")
        self._files: dict[Path, list[dict]] = {}
        self._lock = threading.Lock()

    def _merged(self, split: str) -> Path | None:
        for suffix in (".parquet", ".jsonl"):
            if (self.root / f"{split}{suffix}").is_file():
                return self.root / f"{split}{suffix}"
        return None

    def _flashrag(self, split: str, dataset: str) -> Path:
        order = ("test", "dev", "train") if split == "test" else ("train",)
        for name in order:
            for suffix in (".jsonl", ".parquet"):
                if (self.root / dataset / f"{name}{suffix}").is_file():
                    return self.root / dataset / f"{name}{suffix}"
        raise FileNotFoundError(f"{self.root} has neither {split}.parquet nor {dataset}/{{{','.join(order)}}}.jsonl; "
                                f"download {dataset} from RUC-NLPIR/FlashRAG_datasets into it")

    def _rows(self, path: Path, expected: int) -> list[dict]:
        with self._lock:
            if path not in self._files:
                rows = _read_rows(path)
                if len(rows) != expected:
                    raise ValueError(f"{path} has {len(rows)} rows but AgentGym's id range for it has {expected}; "
                                     "it is not the file upstream used")
                self._files[path] = rows
            return self._files[path]

    def task(self, task_id: int) -> Task:
        split, dataset, start, end = _range_of(task_id)
        merged = self._merged(split)
        if merged is not None:
            first, last = SPLIT_RANGES[split]
            row = self._rows(merged, last - first)[task_id - first]
        else:
            row = self._rows(self._flashrag(split, dataset), end - start)[task_id - start]
        return Task(_question(row["question"]), _answers(row), dataset)
