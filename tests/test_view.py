"""The trajectory viewer (scripts/view.py) on a real run: what it lists, filters and shows equals the logs, the env
pictures replay the logged episode, older logs open, nothing outside the run directory is served, and the page works
in headless Chromium (screenshots are kept in tests/artifacts/)."""

import http.client
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import envs
from rl.model import load_tokenizer
from rl.records import decode_array
from rollout import ChatFormat, ExpertEngine, play

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", ROOT / "tests" / "artifacts"))
spec = importlib.util.spec_from_file_location("view", ROOT / "scripts" / "view.py")
view = importlib.util.module_from_spec(spec)
spec.loader.exec_module(view)


def expert_records(env: str, task_ids: list[int]) -> list[dict]:
    """The envs' scripted experts' episodes, as eval.py logs them."""
    fmt = ChatFormat(load_tokenizer("tiny-agent"))
    environments = [envs.make(env) for _ in task_ids]
    try:
        played = play(ExpertEngine(fmt, environments), fmt, environments, task_ids, horizon=20, max_new_tokens=200,
                      max_tokens=8000)
    finally:
        for environment in environments:
            environment.close()
    return [t.log_record() for t in played]


def older(record: dict, log_format: int) -> dict:
    """A record as an earlier train.py wrote it: format 1 had plain token lists and nothing the update saw; format 0
    (the first) no tokens, task id, category or horizon at all."""
    kept = ["step", "item_id", "group", "reward", "success", "turns", "finish", "error", "tokens", "action_tokens",
            "messages"] + (["token_ids", "action_spans"] if log_format == 1 else [])
    out = {key: record[key] for key in kept}
    if log_format == 1:
        out["token_ids"] = decode_array(record["token_ids"])
    return out


def write_jsonl(path: Path, records: list[dict], torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)


@pytest.fixture(scope="module")
def root(trained, tmp_path_factory):
    """runs/: a 2-step GRPO run with evaluations at steps 0 and 2 (a copy of tests/conftest.py's), an eval.py result of
    TextCraft's expert, and a run whose logs are in the two earlier formats (with a torn last line); beside it, a
    secret the viewer must not serve."""
    base = tmp_path_factory.mktemp("view")
    runs = base / "runs"
    run = shutil.copytree(trained, runs / "grpo")
    textcraft = expert_records("textcraft", envs.splits("textcraft")["test"][:2])
    write_jsonl(runs / "eval" / "textcraft-expert.jsonl", textcraft)
    (runs / "eval" / "textcraft-expert.json").write_text(json.dumps(
        {"model": "tiny-agent", "env": "textcraft", "split": "test", "k": 1, "horizon": 20, "avg@k": 1.0}))
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    write_jsonl(runs / "old" / "rollouts.jsonl", [older(records[0], 0), older(records[1], 1)], torn='{"step": 3, "ite')
    (runs / "old" / "config.json").write_text(json.dumps({"env": "babyai", "algo": "grpo", "model": "tiny-agent"}))
    (base / "secret.txt").write_text("not for the viewer")
    (runs / "grpo" / "link.txt").symlink_to(base / "secret.txt")
    (runs / "outside").symlink_to(base, target_is_directory=True)
    return runs


@pytest.fixture(scope="module")
def server(root):
    server = view.serve(root, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", path)  # sent as written: no client-side normalising of ../
    answer = connection.getresponse()
    return answer.status, answer.read()


def api(port: int, path: str) -> dict:
    status, body = get(port, path)
    assert status == 200, body
    return json.loads(body)


def logs_by_label(port: int) -> dict[str, int]:
    return {f"{log['run']}: {log['label']}": log["log"] for log in api(port, "/api/runs")["logs"]}


@pytest.mark.slow
def test_runs_list_training_steps_and_evaluations(root, server):
    body = api(server, "/api/runs")
    runs = {run["name"]: run for run in body["runs"]}
    assert set(runs) == {"grpo", "old"}  # checkpoints' config.json (the model's) make no run
    metrics = [json.loads(line) for line in (root / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = runs["grpo"]["steps"]
    assert [s["step"] for s in steps] == [1, 2] and all(s["horizon"] == 2 for s in steps)
    assert [s["reward"] for s in steps] == [m["rollout/reward"] for m in metrics[1:]]
    evaluations = runs["grpo"]["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 2] and evaluations[0]["success"] == metrics[0]["eval/success"]
    assert runs["grpo"]["config"]["algo"] == "grpo" and runs["grpo"]["config"]["horizon"] == [2]
    labels = logs_by_label(server)
    assert set(labels) == {"grpo: training rollouts", "grpo: evaluations during training", "old: training rollouts",
                           next(label for label in labels if label.startswith("eval: eval textcraft-expert"))}
    episodes = {f"{log['run']}: {log['label']}": log["episodes"] for log in body["logs"]}
    assert episodes["grpo: training rollouts"] == 8 and episodes["grpo: evaluations during training"] == 16
    assert episodes["old: training rollouts"] == 2  # the torn last line is left out


@pytest.mark.slow
@pytest.mark.parametrize("query", ["success=no", "success=yes", "finish=horizon", "env=textcraft", "category=GoTo",
                                   "min_reward=0.5", "max_turns=1&min_turns=1", "min_step=2&max_step=2", "task=3",
                                   "success=no&env=babyai&min_turns=2"])
def test_filters_pick_exactly_the_matching_trajectories(root, server, query):
    rows = api(server, "/api/trajectories?log=all")["rows"]
    assert len(rows) == 8 + 16 + 2 + 2
    wanted = dict(pair.split("=") for pair in query.split("&"))

    def keep(row):
        checks = {"success": lambda v: row["success"] == (v == "yes"), "finish": lambda v: row["finish"] == v,
                  "env": lambda v: row["env"] == v, "category": lambda v: row["category"] == v,
                  "min_reward": lambda v: row["reward"] >= float(v), "max_turns": lambda v: row["turns"] <= int(v),
                  "min_turns": lambda v: row["turns"] >= int(v), "task": lambda v: str(row["task_id"]) == v,
                  "min_step": lambda v: row["step"] is not None and row["step"] >= int(v),
                  "max_step": lambda v: row["step"] is not None and row["step"] <= int(v)}
        return all(checks[key](value) for key, value in wanted.items())

    found = api(server, f"/api/trajectories?log=all&{query}")
    assert [(r["log"], r["line"]) for r in found["rows"]] == [(r["log"], r["line"]) for r in rows if keep(r)]
    assert found["total"] == sum(map(keep, rows))
    assert set(found["facets"]["env"]) == {"babyai", "textcraft"}


@pytest.mark.slow
def test_token_view_is_the_logged_tokens_with_what_the_update_saw(root, server):
    records = [json.loads(line) for line in (root / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    log = logs_by_label(server)["grpo: training rollouts"]
    tokenizer = load_tokenizer("tiny-agent")
    for line, record in enumerate(records):
        body = api(server, f"/api/trajectory?log={log}&line={line}")
        assert body["summary"]["item_id"] == record["item_id"] and body["messages"] == record["messages"]
        tokens = body["tokens"]
        ids = decode_array(record["token_ids"])
        assert tokens["ids"] == ids and len(tokens["text"]) == len(ids)
        # exact boundaries: the pieces, one per token, join into the whole decoded trajectory
        assert "".join(tokens["text"]) == tokenizer.decode(ids, skip_special_tokens=False)
        positions = [i for start, end in record["action_spans"] for i in range(start, end)]
        assert [i for i, m in enumerate(tokens["mask"]) if m] == positions and len(positions) == record["action_tokens"]
        assert [tokens["sampled"][i] for i in positions] == decode_array(record["sampled_logprobs"])
        assert [tokens["trainer"][i] for i in positions] == decode_array(record["trainer_logprobs"])
        assert {tokens["advantage"][i] for i in positions} == {record["advantages"]}  # GRPO: one per trajectory
        assert all(tokens[key][i] is None for key in ("sampled", "trainer", "advantage") for i in range(len(ids))
                   if i not in set(positions))
        assert tokens["value"] is None  # PPO only


@pytest.mark.parametrize("name", ["tiny-agent", "qwen3", "smollm2"])
def test_token_pieces_join_into_the_decoded_text_and_a_split_character_goes_to_the_token_that_finishes_it(
        name, real_tokenizer):
    tokenizer = view.load_tokenizer("tiny-agent") if name == "tiny-agent" else real_tokenizer(name).backend_tokenizer
    text = "go to the red ball ¡señor! 日本 naïve\n\tcraft 3 oak planks 🙂 ꙮ"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces = view.token_texts(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False) == text
    assert "\ufffd" not in "".join(pieces)
    for character in "¡ñ日本ï🙂ꙮ":  # each multi-byte character shows whole, in the one token that finishes it
        assert sum(character in piece for piece in pieces) == 1
    assert [p for p in pieces if p.strip()][:3] == ["go", " to", " the"]  # a whole token is its own text
    # a character's leading bytes with nothing after them (a truncated sample) still show, as decode shows them
    assert "" in pieces  # (a rare character, ꙮ, spans tokens in every vocabulary)
    lead = [ids[pieces.index("")]]
    cut = ids[:3] + lead
    assert "".join(view.token_texts(tokenizer, cut)) == tokenizer.decode(cut, skip_special_tokens=False)
    assert view.token_texts(tokenizer, cut)[-1].endswith("\ufffd")
    # and a stray one in the middle goes, replaced, to the token after it: the pieces still join into the decode
    stray = ids[:3] + lead + ids[:3]
    assert "".join(view.token_texts(tokenizer, stray)) == tokenizer.decode(stray, skip_special_tokens=False)


def test_token_pieces_join_under_a_byte_fallback_decoder_and_cost_a_few_decodes_a_token():
    """SentencePiece's byte fallback (Llama 2, Gemma) decodes a run of byte tokens together, U+FFFD for every byte of
    it when one byte is bad: a character the run completed early is not in the whole decode, and the pieces still join
    into it. A run of stray bytes waits for at most a character's 4 bytes: a few decodes a token, not one per token of
    the run."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "A": 1, "▁": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte = lambda *values: [3 + v for v in values]  # noqa: E731
    whole_character = [1, *byte(0xE6, 0x97, 0xA5), 2, 1]  # A 日 ▁ A
    assert view.token_texts(tokenizer, whole_character) == ["A", "", "", "日", " ", "A"]
    for ids in ([1, *byte(0xE6, 0x97, 0xA5), *byte(0xE6, 0x97), 1],  # 日, then a character cut short, in one run
                [*byte(0xE6, 0x97), 1, *byte(0x80), 2, 1], byte(0x80) * 9):
        pieces = view.token_texts(tokenizer, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False), pieces

    class Counting:
        calls = 0

        def decode(self, ids, skip_special_tokens=False):
            Counting.calls += 1
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    stray = byte(0x80) * 1000
    assert "".join(view.token_texts(Counting(), stray)) == tokenizer.decode(stray) and Counting.calls <= 3 * len(stray)
    assert view._rejoin(["x", "b"], "ab") == ["a", "b"] and view._rejoin(["zz", "q"], "abc") == ["", "abc"]
    assert view._rejoin(["b", "c"], "abc") == ["ab", "c"]  # text skipped before the first token is its own


@pytest.mark.slow
def test_env_state_replays_the_logged_episode(root, server):
    log = logs_by_label(server)["grpo: training rollouts"]
    rows = api(server, f"/api/trajectories?log={log}")["rows"]
    for row in rows:
        state = api(server, f"/api/state?log={log}&line={row['line']}")
        assert state["kind"] == "babyai" and state["diverged"] is None
        assert [s["turn"] for s in state["states"]] == list(range(row["turns"] + 1))  # the reset, then every turn
        assert all(s["image"].startswith("data:image/png;base64,") for s in state["states"])
        assert state["states"][-1]["reward"] == row["reward"]
        assert sum(s["valid"] is False for s in state["states"]) == row["invalid_actions"]  # as the rollout counted
    eval_log = next(n for label, n in logs_by_label(server).items() if "textcraft-expert" in label)
    for row in api(server, f"/api/trajectories?log={eval_log}")["rows"]:
        state = api(server, f"/api/state?log={eval_log}&line={row['line']}")
        first, last = state["states"][0], state["states"][-1]
        assert state["kind"] == "textcraft" and first["inventory"] == {} and row["success"]
        assert last["goal"] in last["inventory"]  # the expert crafted its goal
    # a log whose observation no longer matches the env's (another env version) stops the pictures there
    record = json.loads((root / "grpo" / "rollouts.jsonl").read_text().splitlines()[0])
    record["messages"][4]["content"] = "something else"
    assert view.replay(record, {})["diverged"] == 1 and len(view.replay(record, {})["states"]) == 1


@pytest.mark.slow
def test_older_logs_open(server):
    log = logs_by_label(server)["old: training rollouts"]
    rows = api(server, f"/api/trajectories?log={log}")["rows"]
    # what format 0 lacks is derived from the item id
    assert [r["category"] for r in rows] == [envs.category("babyai", r["task_id"]) for r in rows]
    assert all(r["task_id"] == int(r["item_id"].split("_")[1]) for r in rows)
    format0 = api(server, f"/api/trajectory?log={log}&line=0")
    assert "token ids" in format0["tokens"]["reason"] and format0["messages"]
    format1 = api(server, f"/api/trajectory?log={log}&line=1")["tokens"]
    assert format1["ids"] and sum(format1["mask"]) == rows[1]["action_tokens"] and format1["sampled"] is None
    assert api(server, f"/api/state?log={log}&line=0")["kind"] == "babyai"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/files/../secret.txt", "/files/%2e%2e/secret.txt", "/files/%2E%2E%2Fsecret.txt",
                                  "/files/grpo/../../secret.txt", "/files//etc/passwd", "/files/%2Fetc%2Fpasswd",
                                  "/files/grpo/link.txt", "/files/outside/secret.txt", "/files/grpo/%00x"])
def test_paths_outside_the_run_directory_are_refused(server, path):
    status, body = get(server, path)
    assert status == 403 and b"not for the viewer" not in body


@pytest.mark.slow
def test_files_under_the_run_directory_are_served_and_bad_requests_answered(server):
    status, body = get(server, "/files/grpo/config.json")
    assert status == 200 and json.loads(body)["algo"] == "grpo"
    assert get(server, "/files/grpo/nothing.png")[0] == 404
    assert get(server, "/api/trajectory?log=99&line=0")[0] == 404
    assert get(server, "/api/trajectory?log=0&line=x")[0] == 400
    assert get(server, "/api/trajectories?min_reward=high")[0] == 400
    assert get(server, "/nothing")[0] == 404


def test_a_growing_log_is_followed(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    record = {"step": 1, "item_id": "babyai_3", "reward": 0.5, "success": True, "turns": 1, "finish": "done",
              "messages": []}
    write_jsonl(path, [record], torn='{"step": 2')
    log = view.Log(0, path, "r", "train", "training rollouts")
    log.refresh()
    assert [r["step"] for r in log.rows] == [1]
    with open(path, "a") as file:  # the torn line completed, one more written
        file.write(', "item_id": "babyai_4", "reward": 0, "success": false, "turns": 2, "finish": "horizon", "messages": []}\n')
    log.refresh()
    assert [r["step"] for r in log.rows] == [1, 2] and log.record(1)["item_id"] == "babyai_4"
    write_jsonl(path, [record | {"step": 7}])  # cut back (a resume): read again from the start
    log.refresh()
    assert [r["step"] for r in log.rows] == [7]


def test_an_older_runs_finish_metric_is_read_under_its_new_name(tmp_path):
    """A run from before the horizon had one name logged `finish/max_turns`; the plots read it as `finish/horizon`,
    so old and new runs draw the same line."""
    spec = importlib.util.spec_from_file_location("plot", ROOT / "scripts" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    step = {"charts/step": 1, "rollout/reward": 0.5, "rollout/horizon": 2, "finish/done": 0.25, "finish/max_tokens": 0.0,
            "finish/error": 0.0}
    write_jsonl(tmp_path / "old" / "metrics.jsonl", [step | {"finish/max_turns": 0.75}])
    write_jsonl(tmp_path / "new" / "metrics.jsonl", [step | {"finish/horizon": 0.75}])
    runs = {name: plot.run_metrics(tmp_path / name) for name in ("old", "new")}
    assert runs["old"] == runs["new"]
    assert plot.expand([("finish/*", "*")], runs["old"]) == [("finish/done", "done"), ("finish/error", "error"),
                                                             ("finish/horizon", "horizon"), ("finish/max_tokens", "max_tokens")]
    assert plot.main([str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(tmp_path / "both.png")]).is_file()


@pytest.mark.slow
def test_the_page_in_chromium(root):
    """The real command serves the page; Chromium lists the steps, applies a filter, opens a trajectory, shows its
    tokens and a second one side by side."""
    from playwright.sync_api import sync_playwright

    from envs.webarena.browser import LAUNCH_ARGS, chromium_path

    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "view.py"), str(root), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().split(" at ")[1].split()[0]
        records = [json.loads(line) for line in (root / "grpo" / "rollouts.jsonl").read_text().splitlines()]
        failed = sum(not r["success"] for r in records)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(url)
            page.wait_for_selector("#list tr.traj-row")
            assert page.locator("#runs tr.step-row").count() == 2 and page.locator("#runs tr.eval-row").count() == 2
            page.locator("#runs tr.step-row").first.click()  # step 1's trajectories
            page.wait_for_function("document.querySelector('#count').textContent.startsWith('4 trajectories')")
            page.select_option("#f-log", label=next(o for o in page.locator("#f-log option").all_inner_texts()
                                                    if "grpo: training rollouts" in o))
            page.fill("#f-min_step", "")
            page.fill("#f-max_step", "")
            page.select_option("#f-success", "no")
            page.click("#apply")
            page.wait_for_function(f"document.querySelector('#count').textContent.startsWith('{failed} trajectories')")
            page.locator("#list tr.traj-row").first.click()
            page.wait_for_selector(".pane .turn img")
            line = int(page.locator("#list tr.current").get_attribute("data-line"))
            assert page.locator(".pane .msg.assistant").count() == records[line]["turns"] + 1  # the ack, each action
            assert page.locator(".pane .turn img").count() == records[line]["turns"] + 1  # the grid after each
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "viewer-replay.png"))
            page.click(".tabs button[data-tab=tokens]")
            page.wait_for_selector(".tokens .tok")
            assert page.locator(".tokens .tok").count() == records[line]["tokens"]
            assert page.locator(".tokens .tok:not(.untrained)").count() == records[line]["action_tokens"]
            page.select_option("select.mode", "advantage")
            page.locator(".tokens .tok:not(.untrained)").first.hover()
            assert "advantage" in page.locator(".tokinfo").first.inner_text()
            page.select_option("#compare", index=1)
            page.wait_for_selector(".columns.two .pane >> nth=1")
            page.screenshot(path=str(ARTIFACTS / "viewer-tokens.png"))
            browser.close()
        assert not errors, errors
        assert all((ARTIFACTS / name).stat().st_size > 10_000 for name in ("viewer-replay.png", "viewer-tokens.png"))
    finally:
        process.terminate()
        process.wait(timeout=30)
