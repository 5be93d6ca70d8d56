"""Write the WebArena task-id splits (run once; the outputs are committed).

    python scripts/webarena_splits.py

- envs/data/webarena_{train,test}.json: the local tasks (envs/data/webarena/local_tasks.json), the
  offline default. The two fuzzy_match tasks need an LLM judge, so they are in neither split.
- envs/data/webarena/webarena_{train,test}.json: WebArena's 812 tasks (needs webarena-verified).
  The test split has the paper's shape, 15 Shopping + 15 CMS + 10 Maps + 10 G&R tasks, drawn with
  random.Random(0) from each category; the other 762 tasks are the train split. (The paper's own 50
  ids are not published.)
"""

import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import envs  # noqa: E402
from envs.webarena import tasks  # noqa: E402

LOCAL_TEST = [6, 9, 11, 13]  # string+url, url, program_html, two tabs
PAPER_TEST = {"Shopping": 15, "CMS": 15, "Maps": 10, "G&R": 10}

local = tasks.configs("local")
judged = {i for i, c in enumerate(local) if "fuzzy_match" in (c["eval"]["reference_answers"] or {})}
local_train = [i for i in range(len(local)) if i not in judged and i not in LOCAL_TEST]
envs.save_task_ids(envs.DATA_DIR / "webarena_train.json", "webarena", local_train)
envs.save_task_ids(envs.DATA_DIR / "webarena_test.json", "webarena", LOCAL_TEST)
print(f"local: {len(local_train)} train, {len(LOCAL_TEST)} test, {sorted(judged)} need a judge")

by_category = defaultdict(list)
for i in range(len(tasks.configs("webarena"))):
    by_category[tasks.category("webarena", i)].append(i)
rng = random.Random(0)
test = sorted(i for name, n in PAPER_TEST.items() for i in rng.sample(by_category[name], n))
train = [i for i in range(len(tasks.configs("webarena"))) if i not in set(test)]
envs.save_task_ids(tasks.DATA / "webarena_train.json", "webarena", train)
envs.save_task_ids(tasks.DATA / "webarena_test.json", "webarena", test)
print(f"webarena: {len(train)} train, {len(test)} test; categories {({k: len(v) for k, v in by_category.items()})}")
