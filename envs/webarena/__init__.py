"""WebArena in a real browser: AgentGym's WebArena environment, in process, on Playwright + Chromium.

    env = envs.make("webarena")                       # local sites, offline
    env = envs.make("webarena", sites="webarena")     # WebArena's 812 tasks on your own WebArena sites

The agent gets upstream's instruction, then observations in upstream's template

    OBSERVATION:
    Tab 0 (current): <title>

    [1] RootWebArea '<title>' focused: True
    	[42] link 'Sign In'
    ...
    URL: http://onestopmarket.com/...
    OBJECTIVE: <intent>
    PREVIOUS ACTION: <the last action, described>

(the accessibility tree of the viewport, observation.py; URLs under their real-world aliases) and
acts with WebArena's grammar inside triple backticks (actions.py). `stop [answer]` ends the
episode; the reward is then the product of the task's evaluators (evaluators.py), else 0.

The state key (Env.state_key, GiGPO's anchor groups) is a digest of what the last observation read: the URL, the
tab line and tree without their element ids, and the values typed into the page's fields, all under the sites'
aliases. Not the ids, since a page loaded again numbers its elements anew (two routes to one page must meet); the
typed values, since the tree does not show them and the same page with other text in its search box is another
state. Not the objective (fixed by the task) nor PREVIOUS ACTION (history). Left out: what a site holds that the
page does not show (the cart on another page), so such episodes share a key; on WebArena's own sites, text that
changes with the clock ("2 hours ago") can keep equal states apart.

Tasks (tasks.py): with WebArena's site variables (SHOPPING=http://host:7770, ...) set, or
sites="webarena", task id i is test.raw.json's task i (812 tasks, from the package
webarena-verified). Otherwise, or with sites="local", task id i is
envs/data/webarena/local_tasks.json's task i, on a small shop, forum and homepage that this
process serves on 127.0.0.1 (sites.py); those tasks come with an oracle action list.

Default data: offline, the local tasks, which are not WebArena's; their splits are
envs/data/webarena_{train,test}.json (11 / 4; the two fuzzy_match tasks need a judge and are in
neither). For the 812 the splits are envs/data/webarena/webarena_{train,test}.json (762 / 50): the
50 have the paper's shape, 15 Shopping + 15 CMS + 10 Maps + 10 G&R, but are drawn at random
(scripts/webarena_splits.py), as the paper's own ids are not published. default_split_files()
picks the pair. With the paper's ids in an AgentGym-RL-Data-ID file, run them with `python
train.py --env webarena --train-tasks FILE` or `python eval.py --env webarena --tasks FILE`.
Eval categories (Shopping, CMS, Maps, G&R) go by a task's first site, our rule.

One Chromium per process (browser.py), one isolated browser context per env, all Playwright calls
on one browser thread: safe to step many envs from a thread pool. A hung page, crashed tab or
dead browser raises BrowserError from reset/step (that trajectory ends); the next reset starts
over in a new context, on a new browser if the old one died.

What the browser may reach: the configured sites, plus fetches (not navigation) from the map's
services. Every other request is aborted, whoever makes it: a `goto` elsewhere is refused with an
observation that says so; links, redirects, frames, images, scripts and XHR to other hosts or
schemes (file://, chrome://, ...) fail as if offline, and env.blocked lists them. Why: the tasks
are meant to be solved on WebArena's self-hosted sites, and a browser that reaches the live web
(the real GitLab or OpenStreetMap, a search engine) or this machine's files could answer from
there; upstream blocks nothing. The map's services: WebArena's map front end fetches its tiles and
calls Nominatim and OSRM from the browser, on ports 8080, 8085 and 5000-5002 of its backend host
(tasks.MAP_SERVICE_PORTS says where that comes from); without them the map shows no tiles and
directions tasks cannot be done. By default those ports of MAP's host are allowed; a backend on
another host (WebArena's AMI takes it as MAP_BACKEND_IP) needs `map_services`.

make() options (strings are accepted, as they come from the command line):
    sites          auto | local | webarena (auto: webarena when a site variable is set)
    chromium       Chromium executable (default $WEBARENA_CHROMIUM or /usr/bin/chromium)
    max_obs_chars  cap on the tab line + tree text, cut at a line end with a marker line; 0
                   (default) means no cap, as upstream, which never cuts the tree
    settle_s       after an action, wait at least this long and until navigations finished
                   (default 1.5 s on WebArena's sites, upstream's sleep_after_execution; 0.1 s locally)
    nav_timeout_s  limit for one page load (default 30)
    timeout_s      limit for one browser call: reset, step or evaluation (default 120)
    map_services   origins pages may fetch from besides the sites, for the map's tiles, geocoding
                   and routing: auto (default: MAP's host on ports 8080, 8085, 5000, 5001, 5002),
                   none, or origins separated by commas (http://backend:8080,http://backend:5000,...)
    judge_base_url / judge_api_key / judge_model
                   OpenAI-compatible endpoint for fuzzy_match (default $OPENAI_BASE_URL,
                   $OPENAI_API_KEY, gpt-4-1106-preview). Without one, a task that needs the judge
                   scores 0 and info["eval_skipped"] says why.

Where this port deliberately differs from upstream:
- Upstream sleeps 1.5 s after every action; here the env waits until navigations started by the
  action have finished and at least `settle_s` has passed (an Enter waits up to 1 s for the navigation it
  starts to commit first: envs/webarena/actions.py), and an observation whose page is still loading (a
  navigation whose loading events came after the wait) is taken again once it has loaded.
- Requests outside the sites and the map's services are blocked (above) and a `goto` outside
  the sites is refused (the PREVIOUS ACTION line says so); upstream requested any URL. A `goto`
  to an allowed URL is visited even if it answers an error status, where upstream first fetched
  it with `requests` and silently stayed put on anything but 200.
- URLs in PREVIOUS ACTION are shown under their aliases, like the URL line; upstream showed the
  local address the model never saw.
- An empty action block answers "Invalid action " (upstream: "list index out of range").
- Logins are made per env and site with upstream's auto-login steps, kept 30 minutes and handed
  to each of the env's new contexts, instead of a cookie folder refreshed by a subprocess and
  shared by every env. An episode that logs out (a request to the site's log-out path,
  tasks.LOGOUT_PATHS) ends that session on the server: upstream's shared cookies then left every
  other env logged out until the folder was refreshed; here only that env's session ends, and
  its next reset logs in anew.
- `require_reset` tasks on real sites get no site reset, as upstream: reset your WebArena
  containers between evaluation runs if you need pristine state.
- A failure of the browser or a site (a start page that does not load, a hung page, a dead
  browser, an evaluation that cannot reach its site) raises BrowserError, which ends that
  trajectory as an error. Upstream's reset answered "TimeoutError" and its client raised; any
  other exception in a step became the observation (its message), with reward 0.
- A step after `stop` answers "The task is already finished." with the final reward; upstream
  stepped the browser again.
- The browser is the system Chromium, much newer than the build Playwright bundled for upstream,
  so the accessibility tree can differ in details (observation.py lists how its text is made the
  same); the evaluators differ in the small ways evaluators.py lists.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import time
from pathlib import Path
from typing import Callable

from envs import DATA_DIR, Env, StepResult, canonical_key
from envs.tools import Param, Tool
from envs.webarena import tasks
from envs.webarena.actions import ActionParsingError, describe, execute, first_block, parse, spelled
from envs.webarena.browser import BROWSER, BrowserError, chromium_path
from envs.webarena.evaluators import Judge, JudgeMissing, program_html, string_match, url_match
from envs.webarena.observation import VIEWPORT, observe
from envs.webarena.sites import local_sites

INSTRUCTION = (
    "You are an autonomous intelligent agent tasked with navigating a web browser. You will be given web-based "
    "tasks. These tasks will be accomplished through the use of specific actions you can issue.\n\n"
    "Here's the information you'll have:\n"
    "The user's objective: This is the task you're trying to complete.\n"
    "The current web page's accessibility tree: This is a simplified representation of the webpage, providing "
    "key information.\n"
    "The current web page's URL: This is the page you're currently navigating.\n"
    "The open tabs: These are the tabs you have open.\n"
    "The previous action: This is the action you just performed. It may be helpful to track your progress.\n\n"
    "The actions you can perform fall into several categories:\n\n"
    "Page Operation Actions:\n"
    "```click [id]```: This action clicks on an element with a specific id on the webpage.\n"
    "```type [id] [content] [0|1]```: Use this to type the content into the field with id. By default, the "
    "\"Enter\" key is pressed after typing unless the last parameter is set to 0.\n"
    "```hover [id]```: Hover over an element with id.\n"
    "`press [key_comb]`:  Simulates the pressing of a key combination on the keyboard (e.g., Ctrl+v).\n"
    "```scroll [down|up]```: Scroll the page up or down to reveal content below or above the current view.\n\n"
    "Tab Management Actions:\n"
    "```new_tab```: Open a new, empty browser tab.\n"
    "```tab_focus [tab_index]```: Switch the browser's focus to a specific tab using its index.\n"
    "```close_tab```: Close the currently active tab.\n\n"
    "URL Navigation Actions:\n"
    "```goto [url]```: Navigate to a specific URL.\n"
    "```go_back```: Navigate to the previously viewed page.\n"
    "```go_forward```: Navigate to the next page (if a previous 'go_back' action was performed).\n\n"
    "Completion Action:\n"
    "```stop [answer]```: Issue this action when you believe the task is complete. If the objective is to find "
    "a text-based answer, provide the answer in the bracket. If you believe the task is impossible to complete, "
    "provide the answer as \"N/A\" in the bracket.\n\n"
    "Homepage:\n"
    "If you want to visit other websites, check out the homepage at http://homepage.com. It has a list of "
    "websites you can visit.\n\n"
    "To be successful, it is very important to follow the following rules:\n"
    "1. You should only issue an action that is valid given the current observation\n"
    "2. You should only issue one action at a time.\n"
    "3. You should follow the examples to reason step by step and then issue the next action.\n"
    "4.For ALL actions that take parameters, you MUST enclose each parameter in square brackets [].\n"
    "5. Generate the action in the correct format. Start with a \"Let's think step-by-step...In summary, the next "
    "action I will perform is\" phrase, followed by action inside triple backticks (```). For example, \"Let's "
    "think step-by-step. This page has a search box whose ID is [164]. According to the nominatim rule of "
    "openstreetmap, I can search for the restaurants near a location by \"restaurants near\". I can submit my "
    "typing by pressing the Enter afterwards. In summary, the next action I will perform is ```type [164] "
    "[restaurants near CMU] [1]```\".\n"
    "6. Issue stop action when you think you have achieved the objective. Don't generate anything after stop."
)
ACK = "Ok."
NO_ACTION = ("Cannot parse action from response. Your action should be inside triple backticks (```). "
             "Please adjust accordingly.")
# The grammar's actions as native tools (envs/tools.py), each call the action block a reply would write.
ELEMENT = Param("integer", "The element's id, e.g. 12 for [12]")
TOOLS = (
    Tool("click", "Click an element.", {"element": ELEMENT}, "click [{element}]"),
    Tool("type", "Type text into a field.",
         {"element": ELEMENT, "text": Param("string", "What to type"),
          "press_enter": Param("boolean", "Press Enter after it (default true)", required=False)},
         lambda a: f"type [{a['element']}] [{a['text']}] [{int(a.get('press_enter', True))}]",
         reads=r"type \[(?P<element>0|[1-9][0-9]*)\] \[(?P<text>.*)\] \[(?P<press_enter>[01])\]"),
    Tool("hover", "Hover over an element.", {"element": ELEMENT}, "hover [{element}]"),
    Tool("press", "Press a key combination.", {"keys": Param("string", "E.g. Enter or Control+a")}, "press [{keys}]"),
    Tool("scroll", "Scroll the page.", {"direction": Param("string", "Which way", enum=("up", "down"))},
         "scroll [{direction}]"),
    Tool("goto", "Go to a URL.", {"url": Param("string", "The URL")}, "goto [{url}]"),
    Tool("new_tab", "Open a new tab.", {}, "new_tab"),
    Tool("tab_focus", "Switch to a tab.", {"index": Param("integer", "The tab's index")}, "tab_focus [{index}]"),
    Tool("close_tab", "Close the current tab.", {}, "close_tab"),
    Tool("go_back", "Go to the previous page.", {}, "go_back"),
    Tool("go_forward", "Go to the next page.", {}, "go_forward"),
    Tool("stop", "End the task.", {"answer": Param("string", "The answer if one is asked, or N/A if impossible")},
         "stop [{answer}]"),
)
REPLY = "```{action}```"
ELEMENT_ID = re.compile(r"^(\t*)\[\d+\] ", re.MULTILINE)  # a tree line's id, which a reloaded page numbers anew
TEMPLATE = "OBSERVATION:\n{observation}\nURL: {url}\nOBJECTIVE: {objective}\nPREVIOUS ACTION: {previous_action}"
LOGIN_TTL_S = 30 * 60


class WebArena(Env):
    name = "webarena"
    instruction = INSTRUCTION
    ack = ACK

    def __init__(self, task_set: str, sites: tasks.Sites, chromium: str, max_obs_chars: int, settle_s: float,
                 nav_timeout_s: float, timeout_s: float, judge: Judge, map_services: set[str]):
        self.task_set, self.sites, self.judge, self.map_services = task_set, sites, judge, map_services
        self.max_obs_chars, self.settle_s = max_obs_chars, settle_s
        self.nav_timeout_s, self.timeout_s = nav_timeout_s, timeout_s
        BROWSER.use(chromium)
        self.config: dict | None = None
        self.task_id = -1
        # Browser-thread state: this env's context, its current page, a CDP session per page, the
        # launch the context belongs to, and what the route handler refused.
        self._context = None
        self._page = None
        self._sessions: dict = {}
        self._launch = 0
        # This env's logins: site -> (when made, Playwright storage state); its own, since a log-out ends a session
        # for every context holding its cookie (module docstring). Only touched on the browser thread.
        self.logins: dict[str, tuple[float, dict]] = {}
        self.blocked: list[str] = []
        # What the last observation saw (and the values typed into the page's fields, which it does not show).
        self.tree, self.url, self.nodes, self.fields = "", "", {}, ""
        self.history: list[str] = []
        self.done, self.reward, self.broken = False, 0.0, ""
        self.key: str | None = None  # state_key(), made from the last observation

    # -- the Env interface (any thread)

    def reset(self, task_id: int) -> str:
        config = self.sites.fill(tasks.config(self.task_set, task_id))
        self.config, self.task_id = config, task_id
        self.history, self.done, self.reward, self.broken, self.key = ["None"], False, 0.0, "", None
        starts = len(config["start_url"].split(" |AND| ")) + len(tasks.login_sites(config))
        self._call(self._reset(config), self.timeout_s + starts * self.nav_timeout_s)
        self.key = self._state_key()
        return self._render()

    def step(self, text: str) -> StepResult:
        if self.config is None:
            raise RuntimeError("call reset(task_id) before step()")
        if self.broken:
            raise BrowserError(f"this env's browser failed earlier ({self.broken}); reset it")
        if self.done:
            return StepResult("The task is already finished.", self.reward, True, {"valid": False})
        if not re.findall(r"```(.*?)```", text, re.DOTALL):  # upstream's client-side check
            return StepResult(NO_ACTION, 0.0, False, {"valid": False})
        try:
            action = parse(self.sites.to_local(first_block(text)))
        except ActionParsingError as error:  # upstream's server answers with the error alone
            return StepResult(str(error), 0.0, False, {"valid": False})
        self.history.append(describe(action, self.nodes, self.sites.to_alias))
        info = {"valid": True, "action": self.history[-1]}

        if action.kind == "goto" and not self.sites.allows(action.url):
            info["refused"] = action.url
            self.history[-1] += (f" was refused: {self.sites.to_alias(action.url)} is not one of the websites "
                                 "you can visit")
            return StepResult(self._render(), 0.0, False, info)
        fail = self._call(self._act(action), self.timeout_s)
        self.key = self._state_key()
        if fail:
            info["fail_error"] = fail
        if action.kind != "stop":
            return StepResult(self._render(), 0.0, False, info)

        self.done = True
        info["eval"] = self._evaluate(action.answer, info)
        self.reward = 0.0 if "eval_skipped" in info else float(_product(info["eval"].values()))
        return StepResult(self._render(), self.reward, True, info)

    def state_key(self) -> str | None:
        """The digest of the URL and the page's tree as last observed (module docstring); None once the browser
        failed."""
        return None if self.broken else self.key

    def fork(self) -> Env:
        """Refused (Env.fork): a page's state is a browser's and the sites' servers', which cannot be copied."""
        raise NotImplementedError("a webarena env cannot copy its state: the page lives in a browser and on the sites' "
                                  "servers (carts, posts, logins), which offer no copy")

    def close(self) -> None:
        self.key = None
        if self._context is not None:
            try:
                BROWSER.run(self._close_context(), 15)
            except Exception:
                pass

    # -- helpers (caller's thread)

    def _call(self, coroutine, timeout: float):
        try:
            return BROWSER.run(coroutine, timeout)
        except Exception as error:
            self.broken = (str(error) if isinstance(error, BrowserError)
                           else f"{type(error).__name__}: {error}".splitlines()[0])
            if not BROWSER.connected():
                self.broken = f"the browser died ({self.broken})"
            raise BrowserError(f"webarena task {self.task_id}: {self.broken}") from error

    def _state_key(self) -> str:
        tree = ELEMENT_ID.sub(r"\1", self.tree)
        return canonical_key(self.sites.to_alias(f"{self.url}\n{tree}\nfields\n{self.fields}"))

    def _render(self) -> str:
        return TEMPLATE.format(observation=self.tree, url=self.sites.to_alias(self.url),
                               objective=self.config["intent"], previous_action=self.history[-1])

    def _evaluate(self, answer: str, info: dict) -> dict[str, float]:
        eval_types = self.config["eval"]["eval_types"]
        scores = {}
        if "url_match" in eval_types:  # first: program_html may navigate away from the final page
            scores["url_match"] = url_match(self.config, self.url)
        if "program_html" in eval_types:
            targets = len(self.config["eval"]["program_html"])
            scores["program_html"] = self._call(self._program_html(), self.timeout_s + targets * self.nav_timeout_s)
        if "string_match" in eval_types:
            try:
                scores["string_match"] = string_match(self.config, answer, self.judge)
            except JudgeMissing as error:
                info["eval_skipped"] = str(error)
        return scores

    # -- coroutines (browser thread)

    async def _reset(self, config: dict) -> None:
        await self._close_context()
        browser = await BROWSER.browser()
        self._launch = BROWSER.launches
        storage_state = await self._login_state(browser, tasks.login_sites(config))
        options = {"geolocation": config["geolocation"]} if config.get("geolocation") else {}
        self._context = await browser.new_context(
            viewport=VIEWPORT, device_scale_factor=1, storage_state=storage_state, accept_downloads=False,
            service_workers="block", **options)
        self._context.set_default_timeout(self.nav_timeout_s * 1000)
        self.blocked = []
        await self._context.route("**/*", self._route)
        for url in config["start_url"].split(" |AND| "):
            page = await self._context.new_page()
            try:
                await page.goto(url)
            except Exception as error:
                raise BrowserError(f"start page {self.sites.to_alias(url)} did not load: {error}") from None
        self._page = self._context.pages[0]
        await self._page.bring_to_front()
        if await self._settle(self._page, time.monotonic()):
            raise BrowserError(f"start page {self.sites.to_alias(self._page.url)} did not finish loading")
        await self._observe()

    async def _route(self, route) -> None:
        request = route.request
        url = request.url
        for site in [site for site in self.logins if tasks.logs_out(url, site, self.sites.url(site))]:
            del self.logins[site]  # (this session ends on the server: the next reset logs in anew)
        service = tasks.origin(url) in self.map_services and not request.is_navigation_request()
        if url.startswith(("data:", "blob:")) or self.sites.allows(url) or service:
            await route.continue_()
        else:
            self.blocked.append(url)
            await route.abort("blockedbyclient")

    async def _login_state(self, browser, sites: list[str]) -> dict | None:
        if not sites:
            return None
        state = {"cookies": [], "origins": []}
        for site in sites:
            made, saved = self.logins.get(site, (0.0, None))
            if saved is None or time.monotonic() - made > LOGIN_TTL_S:
                context = await browser.new_context(viewport=VIEWPORT)
                context.set_default_timeout(self.nav_timeout_s * 1000)
                try:
                    await tasks.log_in(await context.new_page(), site, self.sites.url(site))
                    saved = await context.storage_state()
                finally:
                    await context.close()
                self.logins[site] = (time.monotonic(), saved)
            state["cookies"] += saved["cookies"]
            state["origins"] += saved["origins"]
        return state

    async def _session(self, page):
        """This page's CDP session, which also tracks whether its main frame is loading."""
        if page not in self._sessions:
            cdp = await self._context.new_cdp_session(page)
            loading = {"frame": (await cdp.send("Page.getFrameTree"))["frameTree"]["frame"]["id"], "now": False,
                       "crashed": False}
            page.on("crash", lambda _: loading.update(crashed=True))

            def started(event):
                if event["frameId"] == loading["frame"]:
                    loading["now"] = True

            def stopped(event):
                if event["frameId"] == loading["frame"]:
                    loading["now"] = False

            cdp.on("Page.frameStartedLoading", started)
            cdp.on("Page.frameStoppedLoading", stopped)
            await cdp.send("Page.enable")
            await cdp.send("Accessibility.enable")
            self._sessions[page] = (cdp, loading)
        return self._sessions[page]

    async def _settle(self, page, since: float) -> str:
        """Wait until `settle_s` has passed since `since` and the page is not loading. A page still
        loading after nav_timeout_s is stopped (as the Esc key would), to be observed as it is; the
        note saying so is returned."""
        cdp, loading = await self._session(page)
        deadline = since + self.nav_timeout_s
        while time.monotonic() - since < self.settle_s or loading["now"]:
            if loading["crashed"]:
                raise BrowserError("the page crashed")
            if time.monotonic() > deadline:
                await cdp.send("Page.stopLoading")
                return f"the page did not finish loading within {self.nav_timeout_s:g} s and was stopped"
            await asyncio.sleep(0.02)
        try:
            await page.wait_for_load_state("load", timeout=max(deadline - time.monotonic(), 0.001) * 1000)
        except Exception:
            if page.is_closed():
                raise
        # Our CDP session's loading events can trail the page: a navigation (e.g. a search submitted
        # with Enter) may have committed unseen, its new document still loading. Wait for that too.
        while time.monotonic() < deadline:
            try:
                if await page.evaluate("document.readyState") == "complete":
                    break
            except Exception:  # the document changed under the call: look again
                if page.is_closed():
                    raise
            await asyncio.sleep(0.02)
        return ""

    async def _observe(self) -> None:
        cdp, loading = await self._session(self._page)
        if loading["crashed"]:
            raise BrowserError("the page crashed")
        self.tree, self.nodes, self.fields = await observe(self._page, cdp, self.max_obs_chars)
        self.url = self._page.url

    async def _act(self, action) -> str:
        """Run the action; upstream's fail_error (the step goes on) or "". Infrastructure failures
        surface in the observation that follows, which raises."""
        since, fail = time.monotonic(), ""
        if (await self._session(self._page))[1]["crashed"]:
            raise BrowserError("the page crashed")
        if action.kind != "stop":
            try:
                self._page = await execute(action, self._page, self.nodes)
            except Exception as error:
                fail = f"{type(error).__name__}: {error}".splitlines()[0]
        if self._page.is_closed():
            self._page = self._context.pages[-1] if self._context.pages else await self._context.new_page()
        stopped = await self._settle(self._page, since)
        await self._observe()
        while not stopped and _loading(self.tree) and time.monotonic() < since + self.nav_timeout_s:
            # a navigation the action started after the settle had looked (its loading events trailing: a click on
            # a link under load), observed mid-load: settle on it and look again
            stopped = await self._settle(self._page, time.monotonic())
            await self._observe()
        return fail or stopped

    async def _program_html(self) -> float:
        async def open_page(url: str) -> None:
            await self._page.goto(url)
            try:
                await self._page.wait_for_load_state("networkidle", timeout=3000)
            except Exception:
                pass

        return await program_html(self.config, self._page, lambda: self.sites.url("shopping"), open_page)

    async def _close_context(self) -> None:
        context, self._context, self._page = self._context, None, None
        self._sessions.clear()
        if context is not None and self._launch == BROWSER.launches:
            try:
                await asyncio.wait_for(context.close(), 10)
            except Exception:
                pass


def read_action(text: str) -> str | None:
    """The action a reply sends, as step() reads it: its first action block, parsed, in plain spelling."""
    block = first_block(text)
    try:
        return None if block is None else spelled(parse(block))
    except ActionParsingError:
        return None


def _loading(tree: str) -> bool:
    """Whether an observation shows its document still loading: the page's root (RootWebArea) marked busy."""
    root = next((line for line in tree.splitlines() if "RootWebArea" in line), "")
    return " busy: 1" in root


def _product(values) -> float:
    score = 1.0
    for value in values:
        score *= value
    return score


def make(sites: str = "auto", chromium: str | None = None, max_obs_chars: int = 0, settle_s: float | None = None,
         nav_timeout_s: float = 30.0, timeout_s: float = 120.0, judge_base_url: str | None = None,
         judge_api_key: str | None = None, judge_model: str = "gpt-4-1106-preview",
         map_services: str = "auto") -> WebArena:
    if importlib.util.find_spec("playwright") is None:
        raise ImportError("the webarena env drives Chromium with Playwright: pip install playwright==1.65.2")
    task_set = tasks.mode(str(sites))
    site_urls = tasks.Sites.from_environment() if task_set == "webarena" else tasks.Sites(dict(local_sites().urls))
    tasks.configs(task_set)  # fail now, with the install hint, if the task data is missing
    if settle_s is None:
        settle_s = 1.5 if task_set == "webarena" else 0.1
    judge = Judge(judge_base_url or os.environ.get("OPENAI_BASE_URL"),
                  judge_api_key or os.environ.get("OPENAI_API_KEY"), str(judge_model))
    return WebArena(task_set, site_urls, chromium_path(chromium), int(max_obs_chars), float(settle_s),
                    float(nav_timeout_s), float(timeout_s), judge, site_urls.map_services(str(map_services)))


def category(task_id: int) -> str:
    """The paper's WebArena columns (Shopping, CMS, Maps, G&R) by the task's first site; the task
    set is chosen as make(sites="auto") would."""
    return tasks.category(tasks.mode(), task_id)


def default_split_files() -> tuple[Path, Path]:
    """Default train/test id files for the task set make(sites="auto") uses: the local tasks'
    (envs/data/webarena_{train,test}.json) or the 812 tasks' (envs/data/webarena/webarena_*.json)."""
    if tasks.mode() == "webarena":
        return tasks.DATA / "webarena_train.json", tasks.DATA / "webarena_test.json"
    return DATA_DIR / "webarena_train.json", DATA_DIR / "webarena_test.json"


def oracle(env: WebArena) -> Callable[[str], str]:
    """The local task's `oracle` action list, played through the text interface: each `{role:name}`
    becomes the id of the first line `[id] role 'name'` of the observation; when that element is not
    in view yet, the expert scrolls down first. WebArena's own 812 tasks have no such lists."""
    plan = env.config.get("oracle") if env.config else None
    if plan is None:
        raise ValueError("only the local WebArena tasks (sites='local') have a scripted expert")
    position = 0

    def act(observation: str) -> str:
        nonlocal position
        action = plan[position]
        for role, name in re.findall(r"\{(\w+):([^}]*)\}", action):
            found = re.search(rf"\[(\d+)\] {role} {re.escape(repr(name))}(?: |$)", observation, re.MULTILINE)
            if found is None:
                return (f"Let's think step-by-step. I need the {role} '{name}', which is not in view. "
                        "In summary, the next action I will perform is ```scroll [down]```")
            action = action.replace(f"{{{role}:{name}}}", found.group(1))
        position += 1
        return ("Let's think step-by-step. This follows my plan for the objective. "
                f"In summary, the next action I will perform is ```{action}```")

    return act
