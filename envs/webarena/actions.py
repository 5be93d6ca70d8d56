"""WebArena's id-based action grammar: parsing, the "previous action" text, and execution.

    click [id]   type [id] [text] [0|1]   hover [id]   press [key_comb]   scroll [up|down]
    new_tab   tab_focus [index]   close_tab   goto [url]   go_back   go_forward   stop [answer]

Parsing is upstream's `create_id_based_action` (the keyword is what comes before the first "[",
`type` presses Enter unless it ends in [0]); the history text is upstream's
`get_action_description`; execution is upstream's `execute_action` for the id-based actions:
clicks and typing go to the centre of the element's box with the mouse and keyboard. `spelled` writes
a parsed action back in plain spelling (for envs/tools.py).

Hostile text is answered in bounded time, with upstream's results for sane actions:
- The bracket patterns (`stop ?\[(.+)\]`, ...) match as upstream's `re.search`, in linear time
  (`_search`): upstream's regex retried every start and rescanned the line from each (40 s on
  "type [1] [x" * 20000).
- A `tab_focus` index too long for int() (Python's 4,300 digits) counts as no such tab.
- `type` types as Playwright's keyboard.type does (`_type`), with two limits. Past TYPED_KEYS
  characters it inserts the rest at once, as a paste does (one input event, no key events): each
  key takes ~4 ms, so 1 MB would type for an hour. And an insertion (a character off the US
  layout, e.g. "é") that gets no answer within INSERT_TIMEOUT_S reloads the page and fails the
  action: Chromium loses the answer to one made while the page navigates (typing "é" into a link),
  after which every later key on that page waits forever; a reload clears it.
- A key combination of more than MAX_COMBO_KEYS keys fails as an unknown key does (the step goes
  on); each key is pressed and released in turn, so 100,000 of them would take minutes.

Enter (a `type` that submits, a `press` with Enter) is given up to NAV_START_S for the navigation it may
start to commit: a form submitted by Enter starts navigating only after the key's events have returned,
sometimes later than the env's settle wait (measured: 3 of 8 searches observed the page before the
search), so the observation showed the page the search left. Upstream waits 1.5 s after every action.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

# Upstream's SPECIAL_KEY_MAPPINGS: lower-case key names the model may write -> Playwright's names.
KEY_NAMES = {
    "control": "Control", "shift": "Shift", "backquote": "Backquote", "minus": "Minus", "equal": "Equal",
    "backslash": "Backslash", "backspace": "Backspace", "meta": "Meta", "tab": "Tab", "delete": "Delete",
    "escape": "Escape", "arrowdown": "ArrowDown", "end": "End", "enter": "Enter", "home": "Home",
    "insert": "Insert", "pagedown": "PageDown", "pageup": "PageUp", "arrowright": "ArrowRight",
    "arrowup": "ArrowUp", **{f"f{i}": f"F{i}" for i in range(1, 13)},
}
ELEMENT_ACTIONS = ("click", "hover", "type")
TYPED_KEYS = 500  # characters of a `type` typed key by key; the rest is inserted at once
INSERT_TIMEOUT_S = 3.0  # an insertion takes milliseconds (1 MB: a fraction of a second)
KEYED = r"\x20-\x7e\n\r"  # (a regex class) what Playwright's US layout presses as keys; it inserts the rest
MAX_COMBO_KEYS = 16  # keys in one `press` combination
NAV_START_S = 1.0  # seconds an Enter's navigation may take to commit before the page is taken to stay
NO_TAB = 1 << 62  # the index of a tab_focus whose digits are too many for int()


class ActionParsingError(Exception):
    pass


@dataclass
class Action:
    kind: str  # click, type, hover, press, scroll, new_tab, tab_focus, close_tab, goto, go_back, go_forward, stop
    element_id: str = ""
    text: str = ""  # for type; ends in "\n" when Enter is to be pressed
    key_comb: str = ""
    direction: str = ""
    url: str = ""
    tab: int = 0
    answer: str = ""


def first_block(response: str) -> str | None:
    """The text inside the first pair of triple backticks, stripped; None if there is none."""
    match = re.search(r"```((.|\n)*?)```", response)
    return match.group(1).strip() if match else None


def _search(start: str, rest: str, text: str) -> re.Match | None:
    """re.search(start + rest, text) in linear time, for `rest` = `(.+)\]` or `(.+)\] ?\[(\d+)\]` (a
    match stays on one line). On a line only the first place `start` matches can match: a later one
    has the same line end and fewer closing brackets after it. So try that one alone, then the next
    line, where re.search retries every start and rescans the rest of the line from each."""
    starts, pattern = re.compile(start), re.compile(start + rest)
    position = 0
    while (found := starts.search(text, position)) is not None:
        if match := pattern.match(text, found.start()):
            return match
        position = text.find("\n", found.end())
        if position == -1:
            return None
    return None


def parse(action_str: str) -> Action:
    action_str = action_str.strip()
    words = action_str.split()
    if not words:  # upstream fails here with "list index out of range"
        raise ActionParsingError(f"Invalid action {action_str}")
    keyword = action_str.split("[")[0].strip() if "[" in action_str else words[0].strip()

    def one(pattern: str, rest: str = "") -> str:
        match = _search(pattern, rest, action_str) if rest else re.search(pattern, action_str)
        if not match:
            raise ActionParsingError(f"Invalid {keyword} action {action_str}")
        return match.group(1)

    match keyword:
        case "click" | "hover":
            return Action(keyword, element_id=one(rf"{keyword} ?\[(\d+)\]"))
        case "type":
            if not (action_str.endswith("[0]") or action_str.endswith("[1]")):
                action_str += " [1]"
            match = _search(r"type ?\[(\d+)\] ?\[", r"(.+)\] ?\[(\d+)\]", action_str)
            if not match:
                raise ActionParsingError(f"Invalid type action {action_str}")
            element_id, text, enter = match.groups()
            return Action("type", element_id=element_id, text=text + ("\n" if enter == "1" else ""))
        case "press":
            keys = one(r"press ?\[", r"(.+)\]")
            return Action("press", key_comb="+".join(KEY_NAMES.get(k.lower(), k) for k in keys.split("+")))
        case "scroll":
            return Action("scroll", direction=one(r"scroll ?\[?(up|down)\]?"))
        case "goto":
            return Action("goto", url=one(r"goto ?\[", r"(.+)\]"))
        case "tab_focus":
            index = one(r"tab_focus ?\[(\d+)\]")
            return Action("tab_focus", tab=int(index) if len(index) <= 18 else NO_TAB)
        case "new_tab" | "go_back" | "go_forward" | "close_tab":
            return Action(keyword)
        case "stop":
            match = _search(r"stop ?\[", r"(.+)\]", action_str)
            return Action("stop", answer=match.group(1) if match else "")
    raise ActionParsingError(f"Invalid action {action_str}")


def spelled(action: Action) -> str:
    """The action in the grammar's plain spelling, which parse() reads back as the same action."""
    match action.kind:
        case "click" | "hover":
            return f"{action.kind} [{action.element_id}]"
        case "type":
            text, enter = action.text.removesuffix("\n"), action.text.endswith("\n")
            return f"type [{action.element_id}] [{text}] [{int(enter)}]"
        case "press":
            return f"press [{action.key_comb}]"
        case "scroll":
            return f"scroll [{action.direction}]"
        case "goto":
            return f"goto [{action.url}]"
        case "tab_focus":
            return f"tab_focus [{action.tab}]"
        case "stop":
            return f"stop [{action.answer}]"
    return action.kind


def describe(action: Action, nodes: dict, url_alias=lambda url: url) -> str:
    """Upstream's text of an action for PREVIOUS ACTION, with its hint when the id is unknown."""
    if action.kind in ELEMENT_ACTIONS:
        if action.element_id not in nodes:
            return (f'Attempt to perfom "{action.kind}" on element "[{action.element_id}]" but no matching '
                    "element found. Please check the observation more carefully.")
        node = " ".join(nodes[action.element_id].text.split()[1:])
        if action.kind == "type":
            typed = action.text.replace("\n", " ")
            return f"type [{action.element_id}] [{typed}] where [{action.element_id}] is {node}"
        return f"{action.kind} [{action.element_id}] where [{action.element_id}] is {node}"
    return {
        "scroll": f"scroll [{action.direction}]",
        "press": f"press [{action.key_comb}]",
        "goto": f"goto [{url_alias(action.url)}]",
        "tab_focus": f"page_focus [{action.tab}]",
        "stop": f"stop [{action.answer}]",
    }.get(action.kind, action.kind)


async def execute(action: Action, page, nodes: dict):
    """Perform `action` on `page`; returns the page that is current afterwards. Raises KeyError for
    an unknown element id, IndexError for an unknown tab and ValueError for too many keys at once,
    which the caller reports as upstream does (the step goes on, only the page does not change).
    `goto` is checked by the caller."""
    context = page.context
    match action.kind:
        case "click" | "type" | "hover":
            x, y = nodes[action.element_id].center()
            if action.kind == "hover":
                await page.mouse.move(x, y)
            else:
                await page.mouse.click(x, y)
            if action.kind == "type":
                await _type(page, action.text)
        case "press":
            key = action.key_comb
            if key.count("+") >= MAX_COMBO_KEYS:
                raise ValueError(f"a key combination of {key.count('+') + 1} keys (at most {MAX_COMBO_KEYS})")
            if "Meta" in key and "Mac" not in await page.evaluate("navigator.platform"):
                key = key.replace("Meta", "Control")
            if "Enter" in key.split("+"):
                await _enter(page, key)
            else:
                await page.keyboard.press(key)
        case "scroll":
            sign = "-" if action.direction == "up" else "+"
            await page.evaluate("(document.scrollingElement || document.body).scrollTop = "
                                f"(document.scrollingElement || document.body).scrollTop {sign} window.innerHeight;")
        case "tab_focus":
            page = context.pages[action.tab]
            await page.bring_to_front()
        case "new_tab":
            page = await context.new_page()
        case "close_tab":
            await page.close()
            page = context.pages[-1] if context.pages else await context.new_page()
        case "go_back":
            await page.go_back()
        case "go_forward":
            await page.go_forward()
        case "goto":
            await page.goto(action.url)
    return page


async def _type(page, text: str) -> None:
    """page.keyboard.type(text), event for event: runs of KEYED characters pressed as keys, any other
    character inserted on its own; past TYPED_KEYS characters, the rest inserted at once."""
    enter = text.endswith("\n")
    text = text.removesuffix("\n")
    for keys, others in re.findall(rf"([{KEYED}]+)|([^{KEYED}]+)", text[:TYPED_KEYS]):
        if keys:
            await page.keyboard.type(keys)
        for char in others:
            await _insert(page, char)
    if text[TYPED_KEYS:]:
        await _insert(page, text[TYPED_KEYS:])
    if enter:
        await _enter(page, "Enter")


async def _enter(page, key: str) -> None:
    """Press `key` (Enter, alone or in a combination) and wait up to NAV_START_S for a navigation it starts to
    commit; an Enter that starts none (a field outside a form) costs the wait."""
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    try:
        async with page.expect_navigation(wait_until="commit", timeout=NAV_START_S * 1000):
            await page.keyboard.press(key)
    except PlaywrightTimeout:
        pass


async def _insert(page, text: str) -> None:
    try:
        await asyncio.wait_for(page.keyboard.insert_text(text), INSERT_TIMEOUT_S)
    except asyncio.TimeoutError:  # Chromium lost it to a navigation: the page takes no input until reloaded
        await page.reload()
        raise TimeoutError(f"inserting text got no answer within {INSERT_TIMEOUT_S:g} s (the page navigated "
                           "meanwhile); the page was reloaded") from None
