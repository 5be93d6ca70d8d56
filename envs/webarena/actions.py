"""WebArena's id-based action grammar: parsing, the "previous action" text, and execution.

    click [id]   type [id] [text] [0|1]   hover [id]   press [key_comb]   scroll [up|down]
    new_tab   tab_focus [index]   close_tab   goto [url]   go_back   go_forward   stop [answer]

Parsing is upstream's `create_id_based_action` (the keyword is what comes before the first "[",
`type` presses Enter unless it ends in [0]); the history text is upstream's
`get_action_description`; execution is upstream's `execute_action` for the id-based actions:
clicks and typing go to the centre of the element's box with the mouse and keyboard.
"""

from __future__ import annotations

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


def parse(action_str: str) -> Action:
    action_str = action_str.strip()
    words = action_str.split()
    if not words:  # upstream fails here with "list index out of range"
        raise ActionParsingError(f"Invalid action {action_str}")
    keyword = action_str.split("[")[0].strip() if "[" in action_str else words[0].strip()

    def one(pattern: str) -> str:
        match = re.search(pattern, action_str)
        if not match:
            raise ActionParsingError(f"Invalid {keyword} action {action_str}")
        return match.group(1)

    match keyword:
        case "click" | "hover":
            return Action(keyword, element_id=one(rf"{keyword} ?\[(\d+)\]"))
        case "type":
            if not (action_str.endswith("[0]") or action_str.endswith("[1]")):
                action_str += " [1]"
            match = re.search(r"type ?\[(\d+)\] ?\[(.+)\] ?\[(\d+)\]", action_str)
            if not match:
                raise ActionParsingError(f"Invalid type action {action_str}")
            element_id, text, enter = match.groups()
            return Action("type", element_id=element_id, text=text + ("\n" if enter == "1" else ""))
        case "press":
            keys = one(r"press ?\[(.+)\]")
            return Action("press", key_comb="+".join(KEY_NAMES.get(k.lower(), k) for k in keys.split("+")))
        case "scroll":
            return Action("scroll", direction=one(r"scroll ?\[?(up|down)\]?"))
        case "goto":
            return Action("goto", url=one(r"goto ?\[(.+)\]"))
        case "tab_focus":
            return Action("tab_focus", tab=int(one(r"tab_focus ?\[(\d+)\]")))
        case "new_tab" | "go_back" | "go_forward" | "close_tab":
            return Action(keyword)
        case "stop":
            match = re.search(r"stop ?\[(.+)\]", action_str)
            return Action("stop", answer=match.group(1) if match else "")
    raise ActionParsingError(f"Invalid action {action_str}")


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
    an unknown element id and IndexError for an unknown tab, which the caller reports as upstream
    does (the step goes on, only the page does not change). `goto` is checked by the caller."""
    context = page.context
    match action.kind:
        case "click" | "type" | "hover":
            x, y = nodes[action.element_id].center()
            if action.kind == "hover":
                await page.mouse.move(x, y)
            else:
                await page.mouse.click(x, y)
            if action.kind == "type":
                await page.keyboard.type(action.text)
        case "press":
            key = action.key_comb
            if "Meta" in key and "Mac" not in await page.evaluate("navigator.platform"):
                key = key.replace("Meta", "Control")
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
