"""What the agent sees: WebArena's accessibility-tree text of the current viewport.

As upstream's `TextObervationProcessor` (observation_type="accessibility_tree",
current_viewport_only=True, viewport 1280x720): Chromium's full accessibility tree from CDP, each
node's box, nodes outside the viewport dropped (their children move up to the parent), then a
depth-first walk printing `[node id] role 'name' property: value ...` with one tab per level,
skipping nameless structural nodes, and finally dropping StaticText lines that repeat one of the
three lines above. The open tabs come first: "Tab 0 (current): title | Tab 1: title".

The ids are Chromium's accessibility node ids, which are the DOM nodes' backend ids: stable for as
long as the element lives, so an id from the observation can be clicked after a scroll.

Differences from upstream, none of which changes what a node's line says:
- Boxes come from one `DOMSnapshot.captureSnapshot` (minus the scroll offset) instead of one
  `getBoundingClientRect` round trip per node, which costs seconds on a large page.
- The `url` property, which Chromium versions newer than upstream's attach to links and the root
  (with the local address in it), is not printed, like the other ignored properties.
- Optionally (`max_chars` > 0, make()'s `max_obs_chars`) the text is capped, cut at a line end,
  with a marker line; by default it is not, as upstream never cuts it (its UTTERANCE_MAX_LENGTH,
  8192, only sizes a gym observation space).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VIEWPORT = {"width": 1280, "height": 720}
IN_VIEWPORT_RATIO_THRESHOLD = 0.6
IGNORED_PROPERTIES = {"focusable", "editable", "readonly", "level", "settable", "multiline", "invalid", "url"}
# Roles that carry nothing when they have neither a name nor properties.
EMPTY_ROLES = {"generic", "img", "list", "strong", "paragraph", "banner", "navigation", "Section",
               "LabelText", "Legend", "listitem"}
TRUNCATED = "[... the rest of the page is cut off here ...]"
FIELD_ROLES = {"textbox", "searchbox", "combobox", "spinbutton", "slider"}  # roles whose value is typed or set


@dataclass
class Node:
    backend_id: int
    bound: tuple[float, float, float, float]  # x, y, width, height in viewport pixels
    text: str  # the node's line: "[id] role 'name' properties"

    def center(self) -> tuple[float, float]:
        x, y, width, height = self.bound
        return x + width / 2, y + height / 2


async def observe(page, cdp, max_chars: int) -> tuple[str, dict[str, Node], str]:
    """The observation text of `page` (tabs, then the viewport's tree), its nodes by id, and field_values()."""
    titles = []
    for i, tab in enumerate(page.context.pages):
        titles.append(f"Tab {i}{' (current)' if tab == page else ''}: {await tab.title()}")
    ax_nodes = (await cdp.send("Accessibility.getFullAXTree", {}))["nodes"]
    boxes = await _boxes(cdp)
    tree, nodes = _render(ax_nodes, boxes)
    return truncate(f"{' | '.join(titles)}\n\n{_drop_repeated_text(tree)}", max_chars), nodes, field_values(ax_nodes)


def field_values(ax_nodes: list[dict]) -> str:
    """What is typed into the page's fields, in or out of view, one "role 'name': value" a line: the tree does not
    show it, and the state key needs it (the same page with other text in its search box is another state)."""
    lines = []
    for node in ax_nodes:
        role, value = node.get("role", {}).get("value"), node.get("value", {}).get("value")
        if role in FIELD_ROLES and value not in (None, ""):
            lines.append(f"{role} {node.get('name', {}).get('value', '')!r}: {value}")
    return "\n".join(lines)


def truncate(text: str, max_chars: int) -> str:
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars - len(TRUNCATED) - 1)
    return text[:max(cut, 0)] + "\n" + TRUNCATED


async def _boxes(cdp) -> dict[int, tuple[float, float, float, float]]:
    """Viewport box of every laid-out DOM node, by backend node id."""
    snapshot = await cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": [], "includeDOMRects": True})
    document = snapshot["documents"][0]
    backend_ids = document["nodes"]["backendNodeId"]
    dx, dy = document.get("scrollOffsetX", 0), document.get("scrollOffsetY", 0)
    # Pseudo-elements (list markers, ::before) have no getBoundingClientRect, so upstream drops them.
    pseudo = set(document["nodes"].get("pseudoType", {}).get("index", []))
    boxes = {}
    for index, (x, y, width, height) in zip(document["layout"]["nodeIndex"], document["layout"]["bounds"]):
        if index not in pseudo:
            boxes.setdefault(backend_ids[index], (x - dx, y - dy, width, height))
    return boxes


def _in_viewport(bound) -> bool:
    x, y, width, height = bound
    if width == 0 or height == 0:
        return False
    overlap_width = max(0, min(x + width, VIEWPORT["width"]) - max(x, 0))
    overlap_height = max(0, min(y + height, VIEWPORT["height"]) - max(y, 0))
    # Upstream's expression, precedence included: (overlap area / width) * height. In effect a
    # node stays when any sizeable part of it is visible.
    return overlap_width * overlap_height / width * height >= IN_VIEWPORT_RATIO_THRESHOLD


def _line(node: dict) -> tuple[str, bool] | None:
    """The node's text and whether it is worth a line; None for nodes without a role or name
    (Chromium's ignored nodes), which upstream skips the same way."""
    try:
        role, name = node["role"]["value"], node["name"]["value"]
    except (KeyError, TypeError):
        return None
    text = f"[{node['nodeId']}] {role} {name!r}"
    properties = []
    for prop in node.get("properties", []):
        if prop["name"] in IGNORED_PROPERTIES or "value" not in prop.get("value", {}):
            continue
        properties.append(f"{prop['name']}: {prop['value']['value']}")
    if properties:
        text += " " + " ".join(properties)
    if not name.strip() and ((not properties and role in EMPTY_ROLES) or (properties and role == "listitem")):
        return text, False
    return text, True


def _render(ax_nodes: list[dict], boxes: dict) -> tuple[str, dict[str, Node]]:
    by_id: dict[str, dict] = {}
    for node in ax_nodes:  # a few nodes come twice; the first one counts
        by_id.setdefault(node["nodeId"], node)
    nodes: dict[str, Node] = {}
    lines: list[str] = []

    def visible_bound(node):
        if node.get("role", {}).get("value") == "RootWebArea":
            return (0.0, 0.0, 10.0, 10.0)  # always inside, as upstream
        bound = boxes.get(node.get("backendDOMNodeId"))
        return bound if bound is not None and _in_viewport(bound) else None

    # Depth-first from the root; a node that is off screen or says nothing is transparent: its
    # children take its place at its depth.
    root = ax_nodes[0]
    stack = [(root["nodeId"], 0)]
    while stack:
        node_id, depth = stack.pop()
        node = by_id[node_id]
        bound = visible_bound(node)
        line = _line(node) if bound is not None else None
        child_depth = depth
        if line is not None and line[1]:
            lines.append("\t" * depth + line[0])
            nodes[node_id] = Node(node["backendDOMNodeId"], bound, line[0])
            child_depth = depth + 1
        for child in reversed(node.get("childIds", [])):
            if child in by_id:
                stack.append((child, child_depth))
    return "\n".join(lines), nodes


_STATIC_TEXT = re.compile(r"\[\d+\] StaticText (.+)", re.DOTALL)


def _drop_repeated_text(tree: str) -> str:
    kept: list[str] = []
    for line in tree.split("\n"):
        if "statictext" in line.lower():
            match = _STATIC_TEXT.search(line)
            if match:
                text = match.group(1)[1:-1]  # the repr quotes
                if text and all(text not in previous for previous in kept[-3:]):
                    kept.append(line)
            continue
        kept.append(line)
    return "\n".join(kept)
