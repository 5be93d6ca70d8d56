"""WebArena port: upstream's grammar and texts, the evaluators, and the real Chromium on the local sites."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import envs
from envs.webarena import NO_ACTION, tasks
from envs.webarena.actions import ActionParsingError, first_block, parse
from envs.webarena.browser import BROWSER, BrowserError, chromium_pids
from envs.webarena.evaluators import (Judge, JudgeMissing, must_include, reddit_get_post_url, string_match,
                                      url_match)
from envs.webarena.sites import PAGE_SIZE, PRODUCTS
from envs.webarena.observation import TRUNCATED, _drop_repeated_text, _render, truncate

ROOT = Path(__file__).resolve().parent.parent
LOCAL = tasks.configs("local")
JUDGED = [i for i, c in enumerate(LOCAL) if "fuzzy_match" in (c["eval"]["reference_answers"] or {})]
needs_chromium = pytest.mark.skipif(
    not Path(os.environ.get("WEBARENA_CHROMIUM", "/usr/bin/chromium")).is_file(),
    reason="Chromium is not installed here (CI installs it: apt-get install -y chromium)")


def act(text: str) -> str:
    return f"Let's think step-by-step. In summary, the next action I will perform is ```{text}```"


def element(observation: str, line: str) -> str:
    """The id of the first observation line that ends with `line` ("link 'Headphones'")."""
    for row in observation.splitlines():
        if row.strip().split("] ", 1)[-1] == line or row.strip().endswith("] " + line):
            return row.strip()[1:].split("]")[0]
    raise AssertionError(f"{line!r} not in the observation:\n{observation}")


def on(kind: str, observation: str, line: str, *args) -> str:
    """Model text doing `kind` on the element of the observation line `line`, e.g. type [12] [JBL] [1]."""
    return act(f"{kind} [{element(observation, line)}]" + "".join(f" [{arg}]" for arg in args))


def play(env, task_id: int) -> envs.StepResult:
    result = envs.oracle_episode(env, task_id, horizon=25)
    assert result.done, "the oracle did not finish"
    return result


# ----------------------------------------------------------------------------------------------
# Without a browser: parsing, texts, evaluators, task data


@pytest.mark.parametrize("text, expected", [
    ("click [12]", dict(kind="click", element_id="12")),
    ("click[7]", dict(kind="click", element_id="7")),
    ("hover [3]", dict(kind="hover", element_id="3")),
    ("type [164] [restaurants near CMU] [1]", dict(kind="type", element_id="164", text="restaurants near CMU\n")),
    ("type [5] [no enter] [0]", dict(kind="type", element_id="5", text="no enter")),
    ("type [5] [enter by default]", dict(kind="type", element_id="5", text="enter by default\n")),
    ("press [control+a]", dict(kind="press", key_comb="Control+a")),
    ("press [Enter]", dict(kind="press", key_comb="Enter")),
    ("scroll [down]", dict(kind="scroll", direction="down")),
    ("scroll up", dict(kind="scroll", direction="up")),
    ("goto [http://onestopmarket.com/x]", dict(kind="goto", url="http://onestopmarket.com/x")),
    ("tab_focus [2]", dict(kind="tab_focus", tab=2)),
    ("new_tab", dict(kind="new_tab")), ("close_tab", dict(kind="close_tab")),
    ("go_back", dict(kind="go_back")), ("go_forward", dict(kind="go_forward")),
    ("stop [$279.49]", dict(kind="stop", answer="$279.49")),
    ("stop", dict(kind="stop", answer="")),
])
def test_action_grammar_parses_as_upstream(text, expected):
    action = parse(text)
    for key, value in expected.items():
        assert getattr(action, key) == value


@pytest.mark.parametrize("text, message", [
    ("dance [1]", "Invalid action dance [1]"),
    ("click [abc]", "Invalid click action click [abc]"),
    ("type [5]", "Invalid type action type [5] [1]"),
    ("tab_focus [x]", "Invalid tab_focus action tab_focus [x]"),
    ("", "Invalid action "),
])
def test_unparsable_actions_give_upstreams_messages(text, message):
    with pytest.raises(ActionParsingError) as error:
        parse(text)
    assert str(error.value) == message


def test_only_the_first_triple_backtick_block_counts():
    assert first_block("a ```click [1]``` b ```click [2]```") == "click [1]"
    assert first_block("```\nstop [multi\nline]\n```") == "stop [multi\nline]"
    assert first_block("no block") is None


def _ax(node_id, role, name, children=(), backend=None, properties=()):
    node = {"nodeId": node_id, "role": {"value": role}, "childIds": list(children),
            "properties": [{"name": k, "value": {"value": v}} for k, v in properties]}
    if name is not None:
        node["name"] = {"value": name}
    if backend is not None:
        node["backendDOMNodeId"] = backend
    return node


def test_tree_text_follows_upstreams_rules():
    nodes = [
        _ax("1", "RootWebArea", "Shop", ["2", "3", "4", "7", "8"], 1, [("focused", True)]),
        _ax("2", "generic", "", ["5"], 2),  # nameless generic: not printed, its child moves up
        _ax("3", "link", "Below the fold", [], 3),
        _ax("4", "none", None, ["6"], 4),  # an ignored node (no name): transparent
        _ax("5", "textbox", "Search", [], 5, [("focusable", True), ("required", False)]),
        _ax("6", "heading", "Title", ["9"], 6, [("level", 1)]),
        _ax("7", "listitem", "", [], 7, [("setsize", 3)]),  # nameless list item with properties: dropped
        _ax("8", "link", "url hidden", [], 8, [("url", "http://127.0.0.1:1/x")]),
        _ax("9", "StaticText", "Title", [], 9),  # repeats the heading's text
    ]
    boxes = {2: (0, 0, 100, 20), 3: (0, 2000, 100, 20), 4: (0, 30, 100, 20), 5: (0, 0, 50, 20),
             6: (0, 30, 100, 20), 7: (0, 60, 100, 20), 8: (0, 90, 100, 20), 9: (0, 30, 40, 20)}
    tree, found = _render(nodes, boxes)
    assert tree == ("[1] RootWebArea 'Shop' focused: True\n\t[5] textbox 'Search' required: False\n"
                    "\t[6] heading 'Title'\n\t\t[9] StaticText 'Title'\n\t[8] link 'url hidden'")
    assert "StaticText" not in _drop_repeated_text(tree)
    assert set(found) == {"1", "5", "6", "8", "9"} and found["5"].center() == (25.0, 10.0)


def test_truncation_cuts_at_a_line_end():
    text = "\n".join(f"[{i}] link 'item {i}'" for i in range(1000))
    cut = truncate(text, 500)
    assert len(cut) <= 500 and cut.endswith("\n" + TRUNCATED)
    assert all(line.startswith("[") and line.endswith("'") for line in cut.split("\n")[:-1])
    assert truncate("short", 500) == "short" and truncate(text, 0) == text


def test_string_match_approaches():
    config = {"intent": "q", "eval": {"reference_answers": {"exact_match": "Quest Lumaflex™ Band"}}}
    assert string_match(config, '"quest lumaflex™ band"', Judge(None)) == 1.0
    assert string_match(config, "Quest Lumaflex Band", Judge(None)) == 0.0
    config["eval"]["reference_answers"] = {"must_include": ["0"]}
    assert string_match(config, "There are 0 orders.", Judge(None)) == 1.0
    assert string_match(config, "There are 10 orders.", Judge(None)) == 0.0  # one character: a whole token
    assert must_include("3", "3,000 items", tokenize=True) == 0.0
    config["eval"]["reference_answers"] = {"must_include": ["alice", "bob"]}
    assert string_match(config, "Alice and Bob", Judge(None)) == 1.0
    assert string_match(config, "Alice", Judge(None)) == 0.0
    config["eval"]["reference_answers"] = {"fuzzy_match": ["about 5"]}
    with pytest.raises(JudgeMissing):
        string_match(config, "five", Judge(None))
    config["eval"]["reference_answers"] = {"fuzzy_match": "N/A"}
    assert string_match(config, "N/A", Judge(None)) == 1.0
    with pytest.raises(JudgeMissing):
        string_match(config, "it does not exist", Judge(None))


@pytest.mark.parametrize("url, score", [
    ("http://shop/kitchen.html?product_list_order=price&product_list_dir=desc", 1.0),
    ("http://shop/kitchen.html/?product_list_dir=desc&p=2&product_list_order=price", 1.0),
    ("http://shop/kitchen.html?product_list_order=price", 0.0),  # a reference parameter is missing
    ("http://shop/office.html?product_list_order=price&product_list_dir=desc", 0.0),  # wrong path
    ("http://shop/cables.html?product_list_dir=asc&product_list_order=name", 1.0),  # the |OR| alternative
])
def test_url_match_gold_in_pred(url, score):
    config = {"eval": {"reference_url": "http://shop/kitchen.html?product_list_order=price&product_list_dir=desc"
                                        " |OR| http://shop/cables.html?product_list_order=name&product_list_dir=asc"}}
    assert url_match(config, url) == score


ISSUES = "http://gl:8023/a11yproject/a11yproject.com/-/issues"  # task 45's reference, GITLAB filled in
SEARCH = "http://shop:7770/catalogsearch/result"  # task 274's


@pytest.mark.parametrize("reference, url, score", [
    # WebArena keeps the "/" before "?" in the reference: GitLab's own URL without it scores 0
    # there (tasks 45, 46, 102-106, 274-278, 324-328, 339-343), and so it does here.
    (f"{ISSUES}/?sort=created_asc&state=opened", f"{ISSUES}?sort=created_asc&state=opened", 0.0),
    (f"{SEARCH}/?q=usb+wifi", f"{SEARCH}?q=usb+wifi", 0.0),
    (f"{ISSUES}/?sort=created_asc&state=opened", f"{ISSUES}/?state=opened&sort=created_asc", 1.0),
    (f"{ISSUES}/?sort=created_asc&state=opened", f"{ISSUES}/?sort=created_asc", 0.0),
    (f"{SEARCH}/?q=usb+wifi", f"{SEARCH}/?q=usb%20wifi&p=2", 1.0),
    (f"{ISSUES}/", f"{ISSUES}", 1.0),  # a trailing "/" of the whole URL is stripped on both sides
    (f"{ISSUES}", f"{ISSUES}/?sort=created_asc", 1.0),
])
def test_url_match_scores_as_webarena(reference, url, score):
    """Scores as WebArena's URLEvaluator gives them (checked by running it on these pairs)."""
    assert url_match({"eval": {"reference_url": reference, "url_note": "GOLD in PRED"}}, url) == score


def test_url_match_knows_only_gold_in_pred():
    with pytest.raises(ValueError, match="unknown url matching rule"):
        url_match({"eval": {"reference_url": ISSUES, "url_note": ""}}, ISSUES)


def test_reddit_post_url_helper():
    assert reddit_get_post_url("http://h:1/f/books/15/reading_list/comment/3") == "http://h:1/f/books/15/"
    assert reddit_get_post_url("http://h:1/user/alice") == "http://h:1/user/alice"


def test_sites_fill_placeholders_and_map_aliases():
    sites = tasks.Sites({"shopping": "http://10.0.0.1:7770", "shopping_admin": "http://10.0.0.1:7780/admin",
                         "reddit": "http://10.0.0.1:999"})
    filled = sites.fill({"start_url": "__SHOPPING_ADMIN__/x |AND| __SHOPPING__", "eval": {"u": "__REDDIT__/f"}})
    assert filled == {"start_url": "http://10.0.0.1:7780/admin/x |AND| http://10.0.0.1:7770",
                      "eval": {"u": "http://10.0.0.1:999/f"}}
    with pytest.raises(ValueError, match="GITLAB="):
        sites.fill({"start_url": "__GITLAB__"})
    assert sites.to_alias("http://10.0.0.1:7780/admin/sales http://10.0.0.1:9999/x") == \
        "http://luma.com/admin/sales http://10.0.0.1:9999/x"  # port 999 is not a prefix of 9999
    assert sites.to_local("goto [https://onestopmarket.com/a]") == "goto [http://10.0.0.1:7770/a]"
    assert sites.allows("http://10.0.0.1:999/f") and not sites.allows("http://10.0.0.1:22/")
    assert not sites.allows("file:///etc/passwd")


def test_map_services_default_to_webarenas_map_backend_ports():
    sites = tasks.Sites({"map": "http://10.0.0.1:3000", "shopping": "http://10.0.0.1:7770"})
    assert sites.map_services() == {f"http://10.0.0.1:{port}" for port in (8080, 8085, 5000, 5001, 5002)}
    assert sites.map_services("none") == set() and tasks.Sites({"shopping": "http://h:1"}).map_services() == set()
    assert sites.map_services("http://b:8080, http://b:5000/route") == {"http://b:8080", "http://b:5000"}
    with pytest.raises(ValueError, match="not an origin"):
        sites.map_services("b:8080")


def test_local_tasks_use_the_config_schema_and_cover_every_evaluator():
    assert len(LOCAL) >= 10
    kinds = {t for c in LOCAL for t in c["eval"]["eval_types"]}
    assert kinds == {"string_match", "url_match", "program_html"}
    assert {"must_include", "exact_match", "fuzzy_match"} <= {k for c in LOCAL for k in c["eval"]["reference_answers"] or {}}
    for task_id, config in enumerate(LOCAL):
        assert config["task_id"] == task_id and config["intent"] and config["oracle"][-1].startswith("stop")
    ids = envs.splits("webarena")
    assert not set(ids["train"]) & set(ids["test"]) and not set(JUDGED) & set(ids["train"] + ids["test"])
    assert envs.category("webarena", 0) == "Shopping" and envs.category("webarena", 7) == "G&R"


def test_webarenas_812_tasks_from_the_package():
    try:
        configs = tasks.configs("webarena")
    except FileNotFoundError as error:
        pytest.skip(str(error))
    assert len(configs) == 812 and [c["task_id"] for c in configs] == list(range(812))
    counts = {}
    for i in range(812):
        counts[tasks.category("webarena", i)] = counts.get(tasks.category("webarena", i), 0) + 1
    assert counts == {"Shopping": 192, "CMS": 182, "Maps": 128, "G&R": 310}
    sites = tasks.Sites({site: f"http://wa:{7000 + i}" for i, site in enumerate(tasks.SITE_VARS)})
    for config in configs:
        assert not re.search(r"__[A-Z_]+__", json.dumps(sites.fill(config)))
    test = envs.load_task_ids(tasks.DATA / "webarena_test.json", "webarena")
    assert len(test) == 50 and sorted(tasks.category("webarena", i) for i in test).count("Shopping") == 15


# ----------------------------------------------------------------------------------------------
# In the browser


@pytest.fixture(scope="module")
def env():
    environment = envs.make("webarena", sites="local")
    yield environment
    environment.close()


@needs_chromium
def test_first_observation_is_upstreams_template(env):
    observation = env.reset(0)
    assert observation.startswith("OBSERVATION:\nTab 0 (current): One Stop Market\n\n[")
    assert "] RootWebArea 'One Stop Market' focused: True\n\t[" in observation
    assert "\t[" in observation and "textbox 'Search' required: False" in observation
    assert observation.endswith("\nURL: http://onestopmarket.com/\nOBJECTIVE: What is the price of the Logitech "
                                "M310 Wireless Mouse?\nPREVIOUS ACTION: None")
    assert "127.0.0.1" not in observation
    assert env.instruction.startswith("You are an autonomous intelligent agent tasked with navigating a web browser.")
    assert env.ack == "Ok."


@needs_chromium
def test_bad_output_is_an_observation(env):
    env.reset(0)
    result = env.step("I will click the search box.")
    assert (result.observation, result.reward, result.done) == (NO_ACTION, 0.0, False)
    result = env.step("```dance [3]```")
    assert result.observation == "Invalid action dance [3]" and not result.done
    result = env.step(act("click [999999]"))
    assert result.observation.endswith('PREVIOUS ACTION: Attempt to perfom "click" on element "[999999]" but no '
                                       "matching element found. Please check the observation more carefully.")
    assert result.info["fail_error"].startswith("KeyError")
    result = env.step(act("tab_focus [5]"))
    assert "Tab 0 (current)" in result.observation and result.info["fail_error"].startswith("IndexError")


@pytest.mark.slow
@needs_chromium
def test_a_search_submitted_with_enter_is_observed_on_its_results_page(env):
    """The form's navigation starts after Enter's key events return, sometimes after the settle wait; the
    observation must still be the results page (of 8 long searches, 3 showed the page they left before)."""
    from envs.webarena.actions import TYPED_KEYS

    for attempt in range(8):
        observation = env.reset(0)
        search = element(observation, "textbox 'Search' required: False")
        query = f"{attempt}{'x' * TYPED_KEYS}"  # typed key by key, its end inserted at once, then Enter
        result = env.step(act(f"type [{search}] [{query}] [1]"))
        assert f"URL: http://onestopmarket.com/catalogsearch/result/?q={query}\n" in result.observation


@needs_chromium
def test_every_action_kind_in_the_browser(env):
    observation = env.reset(0)
    search = element(observation, "textbox 'Search' required: False")
    result = env.step(act(f"type [{search}] [wireless] [0]"))  # typed, not submitted
    assert "URL: http://onestopmarket.com/\n" in result.observation
    assert result.observation.endswith(f"PREVIOUS ACTION: type [{search}] [wireless] where [{search}] is "
                                       "textbox 'Search' required: False")
    result = env.step(act("press [Enter]"))
    assert "URL: http://onestopmarket.com/catalogsearch/result/?q=wireless\n" in result.observation
    assert "link 'Logitech M310 Wireless Mouse'" in result.observation
    result = env.step(on("hover", result.observation, "link 'Logitech M310 Wireless Mouse'"))
    hovered = BROWSER.run(env._page.evaluate("[...document.querySelectorAll(':hover')].pop().textContent"), 10)
    assert hovered == "Logitech M310 Wireless Mouse" and "PREVIOUS ACTION: hover [" in result.observation
    result = env.step(on("click", result.observation, "link 'Logitech M310 Wireless Mouse'"))
    assert "URL: http://onestopmarket.com/logitech-m310-wireless-mouse.html\n" in result.observation
    assert "PREVIOUS ACTION: click [" in result.observation and "] where [" in result.observation
    top = env.tree
    result = env.step(act("scroll [down]"))
    assert result.observation.endswith("PREVIOUS ACTION: scroll [down]") and env.tree != top
    assert BROWSER.run(env._page.evaluate("window.scrollY"), 10) > 0
    assert set(re.findall(r"\[(\d+)\]", env.tree)) - set(re.findall(r"\[(\d+)\]", top))  # new elements in view
    env.step(act("scroll [up]"))
    assert env.tree == top
    result = env.step(act("go_back"))
    assert "catalogsearch/result/?q=wireless\n" in result.observation
    result = env.step(act("go_forward"))
    assert "logitech-m310-wireless-mouse.html\n" in result.observation
    result = env.step(act("goto [http://reddit.com/forums]"))
    assert "URL: http://reddit.com/forums\n" in result.observation and "heading 'List of forums'" in result.observation
    assert result.observation.endswith("PREVIOUS ACTION: goto [http://reddit.com/forums]")
    result = env.step(act("new_tab"))
    assert "Tab 0: Forums | Tab 1 (current): \n\n[1] RootWebArea '' focused: True\nURL: about:blank\n" in result.observation
    result = env.step(act("tab_focus [0]"))
    assert "Tab 0 (current): Forums | Tab 1: " in result.observation
    assert result.observation.endswith("PREVIOUS ACTION: page_focus [0]")
    result = env.step(act("close_tab"))
    assert "OBSERVATION:\nTab 0 (current): " in result.observation and "Tab 1" not in result.observation
    result = env.step(act("stop [$24.99]"))
    assert result.done and result.reward == 1.0 and result.observation.endswith("PREVIOUS ACTION: stop [$24.99]")
    again = env.step(act("click [1]"))
    assert again.done and again.reward == 1.0


@needs_chromium
def test_ids_are_stable_and_clickable(env):
    observation = env.reset(1)
    observation = env.step(on("click", observation, "link 'Headphones'")).observation
    names = [p.name for p in PRODUCTS if p.category == "headphones"][:PAGE_SIZE]
    ids = {name: element(observation, f"link '{name}'") for name in names if f"link '{name}'" in observation}
    assert len(ids) >= 3
    env.step(act("scroll [down]"))
    again = env.step(act("scroll [up]")).observation
    assert {name: element(again, f"link '{name}'") for name in ids} == ids  # same elements, same ids
    for name in ids:  # ids belong to a document: after go_back the reloaded page has new ones
        result = env.step(on("click", env.tree, f"link '{name}'"))
        assert f"heading '{name}'" in result.observation and result.info.get("fail_error") is None
        env.step(act("go_back"))


@pytest.mark.slow
@needs_chromium
@pytest.mark.parametrize("task_id", [i for i in range(len(LOCAL)) if i not in JUDGED])
def test_oracle_solves_each_local_task(env, task_id):
    result = play(env, task_id)
    assert result.reward == 1.0, result.info
    assert set(result.info["eval"]) == set(LOCAL[task_id]["eval"]["eval_types"])


@needs_chromium
@pytest.mark.parametrize("task_id, answer, evaluator", [
    (0, "$25.99", "string_match"),  # wrong price
    (1, "17", "string_match"),  # "7" must be a whole token
    (2, "Done", "url_match"),  # stopped on the home page
    (3, "Done", "program_html"),  # nothing in the cart
    (10, "Done", "program_html"),  # no post written
])
def test_evaluators_fail_when_the_task_is_not_done(env, task_id, answer, evaluator):
    env.reset(task_id)
    result = env.step(act(f"stop [{answer}]"))
    assert result.done and result.reward == 0.0 and result.info["eval"][evaluator] == 0.0


@needs_chromium
def test_half_done_task_fails_program_html(env):
    """Adding one headphone instead of two leaves `Qty: 2` out of the cart."""
    observation = env.reset(3)
    observation = env.step(on("type", observation, "textbox 'Search' required: False", "JBL", 1)).observation
    observation = env.step(on("click", observation, "link 'JBL Tune 510BT On-Ear Headphones'")).observation
    observation = env.step(on("click", observation, "button 'Add to Cart'")).observation
    assert "Qty: 1" in observation
    assert env.step(act("stop [Done]")).reward == 0.0


class _Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint that grades like a careful teacher."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"].lower()
        if "reported unachievable reason" in prompt:
            reply = "same" if "not sold" in prompt.split("reported unachievable reason:")[1] else "different"
        else:
            reply = "correct" if "loud" in prompt.split("student answer:")[1] else "incorrect"
        _send(self, json.dumps({"choices": [{"message": {"content": reply.upper()}}]}).encode(),
              {"Content-Type": "application/json"})

    def log_message(self, *args):
        pass


def _send(handler: BaseHTTPRequestHandler, data: bytes, headers: dict[str, str]) -> None:
    """A stand-in server's 200 answer."""
    handler.send_response(200)
    for key, value in {**headers, "Content-Length": str(len(data))}.items():
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(data)


@pytest.mark.slow
@needs_chromium
def test_fuzzy_match_asks_the_judge_endpoint_or_says_it_was_skipped(env):
    fuzzy, not_available = JUDGED
    result = play(env, fuzzy)
    assert result.reward == 0.0 and "needs an LLM judge" in result.info["eval_skipped"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judged = envs.make("webarena", sites="local", judge_base_url=f"http://127.0.0.1:{server.server_port}/v1")
        assert play(judged, fuzzy).reward == 1.0
        judged.reset(fuzzy)
        assert judged.step(act("stop [It is quiet]")).reward == 0.0
        judged.reset(not_available)
        assert judged.step(act("stop [N/A: it is not sold there]")).reward == 1.0  # ua_match: same reason
        judged.reset(not_available)
        assert judged.step(act("stop [It costs $10]")).reward == 0.0
        judged.close()
    finally:
        server.shutdown()


@needs_chromium
def test_navigation_outside_the_sites_is_refused(env):
    env.reset(0)
    for url in ("http://example.com/", "file:///etc/passwd", "chrome://settings"):
        result = env.step(act(f"goto [{url}]"))
        assert result.info["refused"] == url and "URL: http://onestopmarket.com/\n" in result.observation
        assert result.observation.endswith(f"was refused: {url} is not one of the websites you can visit")
    observation = env.step(act("goto [http://homepage.com/test/external]")).observation
    assert env.blocked == ["http://example.com/pixel.png"]  # the image was never fetched
    result = env.step(on("click", observation, "link 'Outside link'"))
    assert "example.com" not in result.observation.split("URL: ")[1] and env.blocked[-1] == "http://example.com/"
    env.step(act("go_back"))
    result = env.step(on("click", env.tree, "link 'Local file'"))
    assert "passwd" not in env.url and "root:" not in result.observation


class _Service(BaseHTTPRequestHandler):
    """A stand-in for a map service (OSRM, Nominatim, tiles) on a loopback port."""

    def do_GET(self):
        self.server.paths.append(self.path)
        _send(self, b'{"code": "Ok"}', {"Access-Control-Allow-Origin": "*"})

    def log_message(self, *args):
        pass


@needs_chromium
def test_pages_fetch_from_the_map_services_and_nowhere_else():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Service) for _ in range(2)]
    for server in servers:
        server.paths = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
    service, other = (f"http://127.0.0.1:{server.server_port}" for server in servers)
    env = envs.make("webarena", sites="local", map_services=service)
    try:
        env.reset(0)
        fetch = "url => fetch(url).then(r => r.text(), () => 'blocked')"
        route = f"{service}/route/v1/driving/-79.9,40.4;-79.9,40.5"
        assert BROWSER.run(env._page.evaluate(fetch, route), 10) == '{"code": "Ok"}'
        assert BROWSER.run(env._page.evaluate(fetch, f"{other}/search?q=cmu"), 10) == "blocked"
        with pytest.raises(Exception, match="ERR_BLOCKED_BY_CLIENT"):  # a service is fetched from, not visited
            BROWSER.run(env._page.goto(f"{service}/"), 10)
        assert env.step(act(f"goto [{service}/]")).info["refused"] == f"{service}/"
        assert env.blocked == [f"{other}/search?q=cmu", f"{service}/"]
        assert [server.paths for server in servers] == [["/route/v1/driving/-79.9,40.4;-79.9,40.5"], []]
    finally:
        env.close()
        for server in servers:
            server.shutdown()
            server.server_close()


@needs_chromium
def test_observation_is_not_cut_unless_a_cap_is_asked_for(env):
    env.reset(0)
    observation = env.step(act("goto [http://homepage.com/test/long]")).observation
    assert len(env.tree) > 8192 and TRUNCATED not in observation  # upstream never cuts the tree
    assert "link 'link number 399 of a long page'" in observation
    capped = envs.make("webarena", sites="local", max_obs_chars="2000")
    try:
        capped.reset(0)
        observation = capped.step(act("goto [http://homepage.com/test/long]")).observation
        assert len(capped.tree) <= 2000 and capped.tree.endswith("\n" + TRUNCATED) and TRUNCATED in observation
    finally:
        capped.close()


@needs_chromium
def test_login_is_made_once_an_env_and_reused_by_its_resets(env):
    observation = env.reset(11)  # needs the forum login
    assert "link 'MarvelsGrantMan136'" in observation and "link 'Log in'" not in observation
    made = env.logins["reddit"][0]
    assert "link 'MarvelsGrantMan136'" in env.reset(12)
    assert env.logins["reddit"][0] == made  # the same login, reused
    assert "link 'Log in'" in env.reset(7)  # a task without require_login starts logged out


def _logged_in(environment) -> bool:
    environment.step(act("goto [http://reddit.com/forums]"))
    return "link 'MarvelsGrantMan136'" in environment.tree and "link 'Log in'" not in environment.tree


@pytest.mark.slow  # (several browser sessions)
@needs_chromium
def test_an_episode_that_logs_out_leaves_every_other_episode_logged_in():
    """A log-out ends its session on the server. With one login shared by every env (upstream's cookie folder; this
    port's per-process cache before), the env playing beside it and every later episode were logged out. Here the
    other env stays logged in mid-episode, and the env that logged out logs in anew at its next reset."""
    one, other = envs.make("webarena", sites="local"), envs.make("webarena", sites="local")
    try:
        one.reset(11)
        other.reset(12)
        logout = re.search(r"\[(\d+)\] link 'Log out'", one.tree)
        assert logout, one.tree
        one.step(act(f"click [{logout.group(1)}]"))
        assert "link 'Log in'" in one.tree and "reddit" not in one.logins  # (its session ended; forgotten)
        assert _logged_in(other)  # the env beside it, mid-episode
        assert "link 'MarvelsGrantMan136'" in one.reset(11) and _logged_in(one)  # a new login at the next reset
        assert other.logins["reddit"][0] < one.logins["reddit"][0]
    finally:
        one.close()
        other.close()


@pytest.mark.slow
@needs_chromium
def test_parallel_envs_from_a_thread_pool_are_isolated():
    pool_envs = [envs.make("webarena", sites="local") for _ in range(4)]
    expected = {0: 1.0, 3: 1.0, 6: 1.0, 13: 1.0}
    tids = list(expected)
    observations = list(ThreadPoolExecutor(4).map(lambda p: p[0].reset(p[1]), zip(pool_envs, tids)))
    experts = [envs.oracle(e) for e in pool_envs]
    results = [None] * 4
    with ThreadPoolExecutor(3) as pool:  # fewer threads than envs: each call may land on another thread
        for _ in range(10):
            live = [i for i in range(4) if results[i] is None or not results[i].done]
            if not live:
                break
            stepped = pool.map(lambda i: pool_envs[i].step(experts[i](observations[i])), live)
            for i, result in zip(live, stepped):
                results[i], observations[i] = result, result.observation
    assert [r.reward for r in results] == [expected[t] for t in tids]
    carts = [BROWSER.run(_cart_text(e), 10) for e in pool_envs]
    assert ["JBL" in cart for cart in carts] == [False, True, False, False]  # only task 3 filled a cart
    for e in pool_envs:
        e.close()


async def _cart_text(env):
    await env._page.goto(env.sites.url("shopping") + "/checkout/cart/")
    return await env._page.content()


# ----------------------------------------------------------------------------------------------
# Faults


@pytest.mark.slow
@needs_chromium
def test_hung_crashed_and_killed_browser_end_one_trajectory_and_recover(monkeypatch):
    env = envs.make("webarena", sites="local", timeout_s=8, nav_timeout_s=2)
    observation = env.reset(0)
    # A renderer stuck in a loop: the step times out, the next reset works.
    env.step(act("goto [http://homepage.com/test/freeze]"))
    started = time.monotonic()
    with pytest.raises(BrowserError, match="did not finish within 8 s"):
        env.step(on("click", env.tree, "button 'Freeze'"))
    assert time.monotonic() - started < 20
    with pytest.raises(BrowserError, match="reset it"):
        env.step(act("scroll [down]"))
    assert "One Stop Market" in env.reset(0)
    # A page whose server never answers: goto gives up, the page is stopped and observed.
    result = env.step(act("goto [http://homepage.com/test/slow]"))
    assert "Timeout" in result.info["fail_error"] and not result.done
    # A crashed tab.
    BROWSER.run(_crash(env), 10)
    with pytest.raises(BrowserError, match="crashed"):
        env.step(act("scroll [down]"))
    assert "One Stop Market" in env.reset(0)
    # A killed browser: a new one is launched on the next reset.
    launches = BROWSER.launches
    ours = chromium_pids()
    browser_pid = next(p for p in ours if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) not in ours)
    os.kill(browser_pid, signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(BrowserError, match="browser died"):
        env.step(act("scroll [down]"))
    observation = env.reset(0)
    assert BROWSER.launches == launches + 1 and browser_pid not in chromium_pids()
    assert env.step(on("type", observation, "textbox 'Search' required: False", "M310", 1)).reward == 0.0
    assert env.step(act("stop [$24.99]")).reward == 1.0
    # A start page that never loads fails the reset itself.
    slow = dict(LOCAL[0], start_url="__HOMEPAGE__/test/slow")
    monkeypatch.setattr(tasks, "config", lambda task_set, task_id: slow)
    with pytest.raises(BrowserError, match="did not load"):
        env.reset(0)
    env.close()


async def _crash(env):
    import asyncio

    cdp, _ = await env._session(env._page)
    try:
        await asyncio.wait_for(cdp.send("Page.crash"), 1)
    except Exception:  # the crash takes the answer with it
        pass


@pytest.mark.slow
@needs_chromium
def test_no_browser_process_survives_the_run():
    script = ("import envs; from envs.webarena.browser import chromium_pids; e = envs.make('webarena', sites='local');"
              "e.reset(0); print(' '.join(map(str, chromium_pids())), flush=True)")
    for ending in ("", "; import os; os._exit(0)"):  # normal exit (atexit), and an exit that skips atexit
        done = subprocess.run([sys.executable, "-c", script + ending], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        pids = [int(p) for p in done.stdout.split()]
        assert pids, done.stderr
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if Path(f"/proc/{p}").exists()]


# ----------------------------------------------------------------------------------------------
# The training loop


@pytest.mark.slow
@needs_chromium
def test_training_loop_runs_on_the_local_sites(tiny_run):
    run_dir, records, _ = tiny_run("webarena", evaluate=False)
    train_ids = set(envs.splits("webarena")["train"])
    assert len(records) == 4
    for record in records:
        assert int(record["item_id"].removeprefix("webarena_")) in train_ids
        first, ack, observation = (m["content"] for m in record["messages"][:3])
        assert first == envs.webarena.INSTRUCTION and ack == "Ok."
        assert observation.startswith("OBSERVATION:\nTab 0 (current): ") and "\nPREVIOUS ACTION: None" in observation
        assert 0.0 <= record["reward"] <= 1.0 and 1 <= record["turns"] <= 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["charts/step"] for m in metrics] == [1]


@pytest.mark.parametrize("url, site, out", [
    ("http://sh:7770/customer/account/logout/", "shopping", True),
    ("http://sh:7770/customer/account/", "shopping", False),
    ("http://sh:7780/admin/admin/auth/logout/", "shopping_admin", True),
    ("http://gl:8023/users/sign_out", "gitlab", True),
    ("http://gl:8023/users/sign_in", "gitlab", False),
    ("http://rd:9999/logout", "reddit", True),
    ("http://rd:9999/f/logout-tips", "reddit", False),
    ("http://other:9999/logout", "reddit", False),  # another site's
])
def test_a_log_out_is_told_by_its_sites_path(url, site, out):
    base = {"shopping": "http://sh:7770", "shopping_admin": "http://sh:7780/admin", "gitlab": "http://gl:8023",
            "reddit": "http://rd:9999"}[site]
    assert envs.webarena.tasks.logs_out(url, site, base) is out


def test_an_observation_of_a_page_still_loading_is_known_as_such():
    """envs/webarena._loading: the tree taken mid-navigation (a click's loading events arriving after the settle, seen
    in CI under load: the log-out test observed /logout's empty busy root) is retaken; a loaded page's is not."""
    from envs.webarena import _loading

    assert _loading("Tab 0 (current): Loading http://127.0.0.1:42365/logout\n\n[107] RootWebArea '' focused: True busy: 1")
    assert not _loading("Tab 0 (current): Postmill\n\n[1] RootWebArea 'Postmill' focused: True\n\t[7] link 'Log in'")
    assert not _loading("Tab 0 (current): Forums\n\n[1] RootWebArea 'Forums' focused: True\n\t[9] StaticText 'busy: 1'")
