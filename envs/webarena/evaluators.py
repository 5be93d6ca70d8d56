"""WebArena's evaluators, rewritten: string_match, url_match and program_html; the score is the product.

- string_match checks the answer of the final `stop [answer]` (lower-cased, outer quotes removed):
  `exact_match`, `must_include` (every phrase a substring; a one-character reference must be a
  whole token), and `fuzzy_match`, which asks an LLM judge through an OpenAI-compatible endpoint
  with upstream's grading prompt. A `fuzzy_match` of "N/A" passes on the answer "N/A", else the
  judge compares the stated reason with the task's `string_note` (upstream's `ua_match`). Without
  a judge endpoint these raise JudgeMissing, which the env reports as a skipped evaluation.
- url_match, exactly as upstream: trailing slashes are stripped from the whole URLs only, so a
  reference `.../-/issues/?sort=x` keeps its `/` before `?` and does not match a final page
  `.../-/issues?sort=x`. One of the reference URLs' host+path must be a substring of the final
  page's, and each reference query parameter must have one of its values in the final URL
  ("GOLD in PRED", the only `url_note` upstream knows).
- program_html: for each target, open its URL in the agent's own browser context ("last" = the
  final page), select text with its JavaScript locator (empty = the whole HTML; `func:` = one of
  upstream's helper functions, parsed, never eval'ed), and require `exact_match` or
  `must_include` (with " |OR| " alternatives).

Deliberate differences: after opening a target page this waits for the page to load and the
network to be idle (at most a few seconds) instead of sleeping 3 s; a judge reply that is neither
"correct" nor "incorrect" scores 0 instead of raising; `must_include`'s tokenizer for
one-character references is a regex in the spirit of NLTK's word_tokenize (no NLTK data needed).
"""

from __future__ import annotations

import ast
import asyncio
import collections
import html
import json
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass


class JudgeMissing(Exception):
    """The task needs an LLM judge (fuzzy_match / ua_match) and none is configured."""


@dataclass
class Judge:
    """An OpenAI-compatible chat endpoint, e.g. base_url="https://api.openai.com/v1"."""

    base_url: str | None
    api_key: str | None = None
    model: str = "gpt-4-1106-preview"  # upstream's judge

    def ask(self, prompt: str) -> str:
        if not self.base_url:
            raise JudgeMissing("fuzzy_match needs an LLM judge: pass judge_base_url=... (or set OPENAI_BASE_URL)")
        body = {"model": self.model, "temperature": 0, "max_tokens": 768, "top_p": 1.0,
                "messages": [{"role": "system", "content": "You are a helpful assistant"},
                             {"role": "user", "content": prompt}]}
        request = urllib.request.Request(
            self.base_url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key or ''}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)["choices"][0]["message"]["content"].lower()


# ----------------------------------------------------------------------------------------------
# string_match


def clean_answer(answer: str) -> str:
    answer = answer.strip()
    if len(answer) > 1 and answer[0] == answer[-1] and answer[0] in "'\"":
        answer = answer[1:-1]
    return answer.lower()


def exact_match(ref: str, pred: str) -> float:
    return float(clean_answer(pred) == clean_answer(ref))


def _tokens(text: str) -> list[str]:
    return re.findall(r"\d+(?:[.,]\d+)+|\w+(?:[-/']\w+)*|[^\w\s]", text)


def must_include(ref: str, pred: str, tokenize: bool = False) -> float:
    ref, pred = clean_answer(ref), clean_answer(pred)
    if tokenize and len(ref) == 1:  # a single character must be a whole token: "0" is not in "10"
        return float(ref in _tokens(pred))
    return float(ref in pred)


def fuzzy_match(ref: str, pred: str, intent: str, judge: Judge) -> float:
    if not pred:
        return float(not ref)
    reply = judge.ask(
        "Help a teacher to grade the answer of a student given a question. Keep in mind that the student may "
        "use different phrasing or wording to answer the question. The goal is to evaluate whether the answer "
        "is semantically equivalent to the reference answer.\n"
        f"question: {intent}\nreference answer: {ref}\n"
        "all the string 'N/A' that you see is a special sequence that means 'not achievable'\n"
        f"student answer: {pred}\nConclude the judgement by correct/incorrect/partially correct.")
    if "partially correct" in reply or "incorrect" in reply:
        return 0.0
    return float("correct" in reply)


def ua_match(reason: str, pred: str, intent: str, judge: Judge) -> float:
    reply = judge.ask(
        f"task: {intent}\nactual unachievable reason: {reason}\nreported unachievable reason: {pred}\n"
        "The task described above is inherently unachievable due to the reason specified under 'actual "
        "unachievable reason'. An individual previously attempted this task and was unable to complete it. "
        "They provided a reason for their failure, which is listed under 'reported unachievable reason'. Your "
        "role is to review both the actual and reported reasons. Determine if the reported reason aligns with "
        "the actual reason, even if implicitly. If the stated reason is in line with the actual reason, respond "
        "with 'same'. Otherwise, respond with 'different'.")
    return 0.0 if "different" in reply else float("same" in reply)


def string_match(config: dict, answer: str, judge: Judge) -> float:
    pred = clean_answer(answer)
    score = 1.0
    for approach, value in config["eval"]["reference_answers"].items():
        if approach == "exact_match":
            score *= exact_match(value, pred)
        elif approach == "must_include":
            for phrase in value:
                score *= must_include(phrase, pred, tokenize=len(value) == 1)
        elif approach == "fuzzy_match":
            if value == "N/A":
                # As upstream, this replaces the score so far: an "N/A" task has no other check.
                score = exact_match("N/A", pred)
                if score != 1:
                    score = ua_match(config["eval"].get("string_note", ""), pred, config["intent"], judge)
            else:
                for reference in value:
                    score *= fuzzy_match(reference, pred, config["intent"], judge)
        else:
            raise ValueError(f"unknown string_match approach {approach!r}")
    return score


# ----------------------------------------------------------------------------------------------
# url_match


def _split_url(url: str) -> tuple[str, dict[str, list[str]]]:
    parts = urllib.parse.urlparse(url)
    return parts.netloc + parts.path, urllib.parse.parse_qs(parts.query)


def url_match(config: dict, url: str) -> float:
    rule = config["eval"].get("url_note", "GOLD in PRED")
    if rule != "GOLD in PRED":
        raise ValueError(f"unknown url matching rule {rule!r}")
    pred_base, pred_query = _split_url(url.rstrip("/"))
    ref_bases, ref_queries = [], collections.defaultdict(set)
    for ref in config["eval"]["reference_url"].split(" |OR| "):
        base, query = _split_url(ref.rstrip("/"))
        ref_bases.append(base)
        for key, values in query.items():
            ref_queries[key].update(values)
    score = float(any(base in pred_base for base in ref_bases))
    for key, values in ref_queries.items():
        score *= float(any(value in pred_query.get(key, []) for value in values))
    return score


# ----------------------------------------------------------------------------------------------
# program_html and upstream's helper functions


def reddit_get_post_url(url: str) -> str:
    """The post's canonical URL for a post or comment URL (http://host/f/forum/id/...)."""
    parts = urllib.parse.urlparse(url)
    path = parts.path.split("/")
    if len(path) < 4 or path[1] != "f":
        return url
    return f"{parts.scheme}://{parts.netloc}/f/{path[2]}/{path[3]}/"


def _shopping_api(shop: str, path: str, params: dict | None = None):
    from envs.webarena.tasks import ACCOUNTS

    token_request = urllib.request.Request(
        f"{shop}/rest/default/V1/integration/admin/token", headers={"content-type": "application/json"},
        data=json.dumps(ACCOUNTS["shopping_admin"]).encode())
    with urllib.request.urlopen(token_request, timeout=60) as response:
        token = json.load(response)
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    request = urllib.request.Request(f"{shop}/rest/V1/{path}{query}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def shopping_get_latest_order_url(shop: str) -> str:
    orders = _shopping_api(shop, "orders", {"searchCriteria[sortOrders][0][field]": "created_at",
                                            "searchCriteria[sortOrders][0][direction]": "DESC",
                                            "searchCriteria[pageSize]": "1"})
    return f"{shop}/sales/order/view/order_id/{int(orders['items'][0]['increment_id'])}/"


def shopping_get_sku_latest_review_author(shop: str, sku: str) -> str:
    reviews = _shopping_api(shop, f"products/{sku}/reviews")
    return reviews[-1]["nickname"] if reviews else ""


def shopping_get_sku_latest_review_rating(shop: str, sku: str) -> str:
    reviews = _shopping_api(shop, f"products/{sku}/reviews")
    return str(reviews[-1]["ratings"][0]["percent"]) if reviews else ""


async def gitlab_get_project_memeber_role(page, account_name: str) -> str:
    try:
        index = await page.evaluate(
            """name => [...document.querySelectorAll("td[data-label='Account'] span.gl-avatar-labeled-sublabel")]
                   .findIndex(e => e.outerText === '@' + name)""", account_name)
        return await page.evaluate(f"() => document.querySelectorAll('td.col-max-role span')[{index}].outerText")
    except Exception:
        return ""


SYNC_HELPERS = {"reddit_get_post_url": reddit_get_post_url}
SHOP_HELPERS = {f.__name__: f for f in (shopping_get_latest_order_url, shopping_get_sku_latest_review_author,
                                        shopping_get_sku_latest_review_rating)}


async def call_helper(expression: str, page, shop_url) -> str:
    """Run a config's `func:name('arg', __page__)` call: only upstream's helpers, literal arguments."""
    call = ast.parse(expression.strip(), mode="eval").body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.keywords):
        raise ValueError(f"not a helper call: {expression!r}")
    args = []
    for arg in call.args:
        if isinstance(arg, ast.Name) and arg.id in ("__page__", "page"):
            args.append(page)
        elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            args.append(arg.value)
        else:
            raise ValueError(f"helper arguments must be strings or __page__: {expression!r}")
    name = call.func.id
    if name in SYNC_HELPERS:
        return SYNC_HELPERS[name](*args)
    if name in SHOP_HELPERS:
        return await asyncio.to_thread(SHOP_HELPERS[name], shop_url(), *args)
    if name == "gitlab_get_project_memeber_role":
        return await gitlab_get_project_memeber_role(*args)
    raise ValueError(f"unknown helper {name!r} in {expression!r}")


async def program_html(config: dict, page, shop_url, open_page) -> float:
    """`open_page(url)` navigates the agent's page and waits for it; `shop_url()` is SHOPPING's URL."""
    score = 1.0
    for target in config["eval"]["program_html"]:
        url = target["url"]
        if url.startswith("func:"):
            url = await call_helper(url[len("func:"):].replace("__last_url__", page.url), page, shop_url)
        if url != "last":
            await open_page(url)
        locator = target["locator"]
        if not locator.strip():
            selected = await page.content()
        elif locator.startswith("document.") or locator.startswith("[...document."):
            for prep in target.get("prep_actions", []):
                try:
                    await page.evaluate(f"() => {prep}")
                except Exception:
                    pass
            try:
                selected = str(await page.evaluate(f"() => {locator}")) or ""
            except Exception:  # the element is not there: the page is wrong
                selected = ""
        elif locator.startswith("func:"):
            selected = await call_helper(locator[len("func:"):], page, shop_url)
        else:
            raise ValueError(f"unknown locator {locator!r}")
        selected = html.unescape(selected)

        required = target["required_contents"]
        if "exact_match" in required:
            score *= exact_match(required["exact_match"], selected)
        elif "must_include" in required:
            for content in required["must_include"]:
                score *= float(any(must_include(option, selected) for option in content.split(" |OR| ")))
        else:
            raise ValueError(f"unknown required_contents {list(required)}")
    return score
