"""Test settings: never touch the network, never wait on wandb, one OpenMP thread a worker; the runs that tests share (one
short training run for every test that only reads a run's outputs) and the short run of each env's training test.
Tests marked `slow` (pytest.ini) take more than a few seconds: `python -m pytest -q -m "not slow"` leaves them out."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py: spinning OpenMP threads starve env threads
if os.environ.get("PYTEST_XDIST_WORKER"):  # several workers on a few cores (pytest.ini): one OpenMP thread each, and in what it
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # launches, so that the workers do not oversubscribe the cores
os.environ.setdefault("AGENTGYM_RL_PLOTS", "0")  # no PNGs at the end of every short run (tests/test_view.py draws them)


import copy  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# What the collection imports (torch, transformers, every test module and what it imports: 800,000 objects) is made
# without the cyclic collector, which would pass over the growing heap some 20 times meanwhile (3-4 s of a worker's
# 16 s collection); pytest_collection below freezes it all and turns the collector back on.
gc.disable()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

# The tiny preset evaluates the initial and final policies on 104 held-out tasks twice each (about a minute a
# run): the tests' short runs do without, unless they ask for it (--eval-every; tests/test_train.py does).
# Tests that run train.py in a subprocess pass --eval-every 0 themselves.
train.PRESETS["tiny"] = dataclasses.replace(train.PRESETS["tiny"], eval_every=0)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One short GRPO run of the embedded model on BabyAI, shared by every test that only reads what a run writes
    (tests/test_train.py, test_view.py, test_vllm.py): 2 steps of 2 tasks x 2 samples, 2 turns of 16 tokens, and
    evaluations of 4 test tasks x 2 at steps 0 and 2, on the default engine (vLLM where it is installed). Its lr,
    1e-4, is not the preset's (a resumed run must keep the run's own) and small enough that the policy still writes
    whole characters at step 2 (at 0.01 it samples stray bytes, which the viewer shows as raw pieces). A test that
    writes into a run (resumes it, draws its curves) works on a copy. Under xdist the run is made once for all
    workers: the first to ask makes it in their common temporary folder, under a lock the others wait on."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # (each worker's base is a folder of the session's)
    made = shared / "trained.json"
    with FileLock(str(shared / "trained.lock")):
        if not made.exists():
            argv = ["--steps", "2", "--tasks-per-step", "2", "--n", "2", "--horizon", "2", "--max-new-tokens", "16",
                    "--lr", "1e-4", "--eval-every", "2", "--eval-tasks", "4",
                    "--out-dir", str(tmp_path_factory.mktemp("trained")), "--run-name", "grpo"]
            made.write_text(json.dumps(str(train.main(train.parse_args(argv)))))
    return Path(json.loads(made.read_text()))


@pytest.fixture
def tiny_run(tmp_path):
    """One training step of the embedded model on an env (2 tasks x 2 samples, 2 turns of 16 tokens),
    then, unless told not to, eval.py on 4 test tasks of its checkpoint. Returns (run directory,
    rollout-log records, eval results or None)."""
    import eval as eval_script
    from rl.flags import build

    def run(env: str, *flags: str, evaluate: bool = True):
        args = train.parse_args(["--env", env, "--steps", "1", "--tasks-per-step", "2", "--n", "2", "--horizon", "2",
                                 "--max-new-tokens", "16", "--out-dir", str(tmp_path), "--run-name", env, *flags])
        run_dir = train.main(args)
        records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
        results = None
        if evaluate:
            results = eval_script.main(build(eval_script.Args, model=str(run_dir / "checkpoints" / "step_1"), limit=4, k=1,
                                                        out=str(tmp_path / "eval")))
        return run_dir, records, results

    return run


# The real tokenizer of each real chat template's models (rl/artifacts.py fetches both at set-up). Llama 3.1's and
# 3.2's tokenizer is Llama 3's with three reserved special tokens renamed; DeepSeek-R1-Distill-Qwen's, which no package
# ships, is Qwen's BPE with R1's special tokens in place of Qwen's first four (the ids R1 gives them: <｜end▁of▁sentence｜>
# 151643, <｜User｜> 151644, <｜Assistant｜> 151645, <｜begin▁of▁sentence｜> 151646); its <think> and </think> stay
# single non-special tokens as in R1, at Qwen3's ids (151667, 151668) rather than R1's (151648, 151649), and its tool
# tokens are left out (its template's calls are refused: rl/chat.py).
TOKENIZER_OF = {"qwen2_5": "qwen3", "qwen3": "qwen3", "qwen3_first_release": "qwen3", "qwen3_instruct_2507": "qwen3",
                "qwen3_thinking_2507": "qwen3", "llama3": "llama3", "llama3_1": "llama3_1", "llama3_2": "llama3_1",
                "deepseek_r1_distill": "r1_distill", "gptoss": "gptoss", "smollm2": "smollm2"}
RENAMED = {"llama3_1": ("llama3", {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}, {}),
           "r1_distill": ("qwen3", {151643: "<｜end▁of▁sentence｜>", 151644: "<｜User｜>", 151645: "<｜Assistant｜>",
                                    151646: "<｜begin▁of▁sentence｜>"},
                          {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                           "pad_token": "<｜end▁of▁sentence｜>"})}


@pytest.fixture(scope="session")
def real_tokenizer(tmp_path_factory):
    """real_tokenizer(template): the real tokenizer of the models that carry the real chat template `template` (a
    name of rl/artifacts.py's templates/, or smollm2: SmolLM2-135M-Instruct's own), speaking it; each tokenizer is
    loaded once a session (2-6 s each)."""
    from transformers import AutoTokenizer

    from rl import artifacts

    loaded = {}

    def base(name):
        if name not in loaded:
            if name in RENAMED:
                source, names, special = RENAMED[name]
                folder = tmp_path_factory.mktemp(name)
                for file in ("tokenizer.json", "tokenizer_config.json"):
                    data = json.loads(artifacts.path(f"tokenizers/{source}/{file}").read_text())
                    for token in data.get("added_tokens", []):
                        token["content"] = names.get(token["id"], token["content"])
                    for key, token in data.get("added_tokens_decoder", {}).items():
                        token["content"] = names.get(int(key), token["content"])
                    if file == "tokenizer_config.json":
                        data.update(special)
                        data.pop("chat_template", None)
                    (folder / file).write_text(json.dumps(data, ensure_ascii=False))
            elif name == "smollm2":  # (the named model's own directory: its template is its tokenizer's)
                folder = artifacts.named_model("smollm2-135m")
            else:
                folder = artifacts.path(f"tokenizers/{name}/tokenizer.json").parent
            loaded[name] = AutoTokenizer.from_pretrained(str(folder))
        return loaded[name]

    def speaking(template):
        tokenizer = copy.copy(base(TOKENIZER_OF[template]))
        if template != "smollm2":
            tokenizer.chat_template = artifacts.path(f"templates/{template}.jinja").read_text()
        return tokenizer

    return speaking


@pytest.hookimpl(tryfirst=True)  # (before `-m` deselects: the slow tests are counted in the fast subset too)
def pytest_collection_modifyitems(items):
    """Files with the most slow tests first, then (xdist's own order) the most tests. Under xdist (pytest.ini: --dist
    loadfile --no-loadscope-reorder) a file goes whole to the next free worker in this order, so the long files start
    early and the last ones handed out are short: no worker is left alone with a long file at the end (by test count
    alone the one-test GPU-check smoke, the soaks and the learning runs came last). A file's own order is kept."""
    slow, tests = {}, {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
        tests[item.path] = tests.get(item.path, 0) + 1
    items.sort(key=lambda item: (-slow[item.path], -tests[item.path]))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    try:
        yield
    finally:
        gc.freeze()  # (what the imports made: no garbage)
        gc.enable()


_FILE = {"path": None, "heap": 0}  # the file whose tests run now, and the heap's size (tracked objects) at its start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test runs with what lived before it frozen out of the cyclic garbage collector (gc.freeze): a worker holds
    700,000 objects and more (torch, transformers, vLLM, every test module), so that each full collection cost 0.2-0.5 s
    and took 18% of tests/test_train.py's and test_async.py's time (56 collections, 25 s, on one worker). What a test
    makes is collected as usual while it runs. Thawed after it. At the end of a file that grew the heap by more than
    10,000 objects (a model, an env's tables, a module fixture's engine), a full collection takes what the file left in
    cycles, which the next test's freeze would otherwise keep; the other files (most of them: a few hundred objects)
    skip it, as each costs 0.4-0.6 s, 23 CPU-seconds over the fast subset's 54 files. What a skipped file left is
    taken by the next collection."""
    gc.freeze()
    if _FILE["path"] != item.path:
        _FILE.update(path=item.path, heap=gc.get_freeze_count())  # (a walk of the frozen list: ~10 ms)
    grown = 0
    try:
        yield
    finally:
        if nextitem is None or nextitem.path != item.path:
            gc.freeze()  # (the last test's objects too)
            grown = gc.get_freeze_count() - _FILE["heap"]
        gc.unfreeze()
        if grown > 10_000:
            gc.collect()
