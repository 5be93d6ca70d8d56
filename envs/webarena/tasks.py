"""Task configs, the websites they run on, URL aliases and logging in.

Two task sets share WebArena's config schema (`sites`, `start_url`, `intent`, `require_login`,
`storage_state`, `eval`, ...):
- "webarena": the 812 tasks of WebArena's test.raw.json, read as data from the PyPI package
  `webarena-verified` (without importing it). Its `__SHOPPING__`-style placeholders are filled
  from WebArena's environment variables SHOPPING, SHOPPING_ADMIN, REDDIT, GITLAB, MAP, WIKIPEDIA,
  HOMEPAGE (e.g. SHOPPING=http://myhost:7770), which must point at self-hosted WebArena sites.
- "local": the tasks in envs/data/webarena/local_tasks.json, on the shop, forum and homepage
  served from this process (sites.py). Each also carries an `oracle` action list.
Task id = index into the list. "auto" picks "webarena" when any of the variables is set.

In observations URLs are shown under their real-world aliases (SHOPPING -> onestopmarket.com,
REDDIT -> reddit.com, ...) and the model's actions are mapped back, as upstream does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DATA = Path(__file__).resolve().parent.parent / "data" / "webarena"
LOCAL_TASKS = DATA / "local_tasks.json"

# Site name -> environment variable, in upstream's URL_MAPPINGS order.
SITE_VARS = {"reddit": "REDDIT", "shopping": "SHOPPING", "shopping_admin": "SHOPPING_ADMIN", "gitlab": "GITLAB",
             "wikipedia": "WIKIPEDIA", "map": "MAP", "homepage": "HOMEPAGE"}
ALIASES = {"reddit": "http://reddit.com", "shopping": "http://onestopmarket.com",
           "shopping_admin": "http://luma.com/admin", "gitlab": "http://gitlab.com",
           "wikipedia": "http://wikipedia.org", "map": "http://openstreetmap.org", "homepage": "http://homepage.com"}
ACCOUNTS = {  # WebArena's accounts; the local sites accept the same ones
    "reddit": {"username": "MarvelsGrantMan136", "password": "test1234"},
    "gitlab": {"username": "byteblaze", "password": "hello1234"},
    "shopping": {"username": "emma.lopez@gmail.com", "password": "Password.123"},
    "shopping_admin": {"username": "admin", "password": "admin1234"},
}
# WebArena's map front end (its openstreetmap-website fork, on MAP's port 3000) calls the map backend
# from the browser, on other ports of the backend host: tiles on 8080, Nominatim (geocoding the
# directions' endpoints) on 8085, OSRM (routes) on 5000 / 5001 / 5002 for car / bike / foot.
# Sources: WebArena's environment_docker/README.md (Map section, "Selecting different routing
# ports") and webarena-map-backend-boot-init.yaml (the backend's `docker run -p` ports).
MAP_SERVICE_PORTS = (8080, 8085, 5000, 5001, 5002)
# Eval categories: the paper's WebArena columns, by a task's first site.
CATEGORIES = {"shopping": "Shopping", "shopping_admin": "CMS", "map": "Maps", "wikipedia": "Maps",
              "gitlab": "G&R", "reddit": "G&R", "homepage": "Shopping"}


def mode(sites: str = "auto") -> str:
    if sites not in ("auto", "local", "webarena"):
        raise ValueError(f"sites must be auto, local or webarena, not {sites!r}")
    if sites == "auto":
        return "webarena" if any(os.environ.get(v) for v in SITE_VARS.values()) else "local"
    return sites


@dataclass
class Sites:
    """Base URL of each configured site (no trailing slash)."""

    urls: dict[str, str]

    @classmethod
    def from_environment(cls) -> "Sites":
        return cls({site: os.environ[var].rstrip("/") for site, var in SITE_VARS.items() if os.environ.get(var)})

    def url(self, site: str) -> str:
        if site not in self.urls:
            raise ValueError(f"this task needs the {site} website: set {SITE_VARS[site]}=http://host:port "
                             "to a running WebArena site (WebArena's environment variables)")
        return self.urls[site]

    def fill(self, config: dict) -> dict:
        """The config with every __SITE__ placeholder replaced by that site's URL."""
        text = json.dumps(config)
        for site in sorted(set(re.findall(r"__([A-Z_]+?)__", text)), key=len, reverse=True):
            name = site.lower()
            if name in SITE_VARS:
                text = text.replace(f"__{site}__", self.url(name))
        return json.loads(text)

    def origins(self) -> set[str]:
        return {origin(url) for url in self.urls.values()}

    def allows(self, url: str) -> bool:
        try:
            return urlsplit(url).scheme in ("http", "https") and origin(url) in self.origins()
        except ValueError:  # not a URL urllib can split ("http://[x", a netloc that changes under NFKC)
            return False

    def map_services(self, option: str = "auto") -> set[str]:
        """Origins that pages may fetch from besides the sites. "auto": MAP's host on WebArena's
        map service ports (none without a MAP site); "none"; or origins separated by commas or
        spaces, for a map backend on another host or other ports."""
        if option == "auto":
            if "map" not in self.urls:
                return set()
            parts = urlsplit(self.urls["map"])
            host = parts.netloc.rsplit(":", 1)[0] if parts.port else parts.netloc
            return {f"{parts.scheme}://{host}:{port}" for port in MAP_SERVICE_PORTS}
        if option == "none":
            return set()
        origins = set()
        for item in option.replace(",", " ").split():
            parts = urlsplit(item)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"map_services: {item!r} is not an origin like http://host:5000; "
                                 "give auto, none, or origins separated by commas")
            origins.add(origin(item))
        return origins

    def to_alias(self, text: str) -> str:
        return _replace(text, {url: ALIASES[site] for site, url in self.urls.items()})

    def to_local(self, text: str) -> str:
        pairs = {}
        for site, url in self.urls.items():
            pairs[ALIASES[site]] = url
            pairs[ALIASES[site].replace("http://", "https://")] = url
        return _replace(text, pairs)


def origin(url: str) -> str:
    return "{0.scheme}://{0.netloc}".format(urlsplit(url))


def _replace(text: str, pairs: dict[str, str]) -> str:
    """Replace each key by its value, longest key first, never inside a longer host or port."""
    if not pairs:
        return text
    keys = sorted(pairs, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(k) + r"(?![\w.:-])" for k in keys))
    return pattern.sub(lambda m: pairs[m.group(0)], text)


@functools.cache
def configs(task_set: str) -> tuple[dict, ...]:
    if task_set == "local":
        return tuple(json.loads(LOCAL_TASKS.read_text()))
    try:
        dist = importlib.metadata.distribution("webarena-verified")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("WebArena's 812 task configs come from the package webarena-verified: "
                                "pip install --no-deps webarena-verified==1.2.3") from None
    return tuple(json.loads(Path(dist.locate_file("webarena_verified/assets/dataset/test.raw.json")).read_text()))


def config(task_set: str, task_id: int) -> dict:
    tasks = configs(task_set)
    if not 0 <= task_id < len(tasks):
        raise ValueError(f"webarena task id {task_id} is out of range: the {task_set} set has {len(tasks)} tasks")
    return tasks[task_id]


def category(task_set: str, task_id: int) -> str:
    return CATEGORIES[config(task_set, task_id)["sites"][0]]


def login_sites(config: dict) -> list[str]:
    """The sites to be logged in to: upstream's storage-state file name, "./.auth/gitlab.reddit_state.json"."""
    if not config.get("require_login") or not config.get("storage_state"):
        return []
    return Path(config["storage_state"]).name.rsplit("_", 1)[0].split(".")


# ----------------------------------------------------------------------------------------------
# Logging in (upstream's auto_login.py), on a page of a throwaway context

# Where each site's log-out link leads (the WebArena sites' and the local ones alike): a request there ends the
# session server-side, for every context that holds its cookie.
LOGOUT_PATHS = {"shopping": "/customer/account/logout", "reddit": "/logout", "shopping_admin": "/admin/auth/logout",
                "gitlab": "/users/sign_out"}


def logs_out(url: str, site: str, base: str) -> bool:
    """Whether a request to `url` logs out of `site`, served at `base`."""
    if not url.startswith(base.rstrip("/") + "/"):
        return False
    return urlsplit(url).path.rstrip("/").endswith(LOGOUT_PATHS[site])


async def log_in(page, site: str, base: str) -> None:
    account = ACCOUNTS[site]
    if site == "shopping":
        await page.goto(f"{base}/customer/account/login/")
        await page.get_by_label("Email", exact=True).fill(account["username"])
        await page.get_by_label("Password", exact=True).fill(account["password"])
        button = page.get_by_role("button", name="Sign In")
    elif site == "reddit":
        await page.goto(f"{base}/login")
        await page.get_by_label("Username").fill(account["username"])
        await page.get_by_label("Password").fill(account["password"])
        button = page.get_by_role("button", name="Log in")
    elif site == "shopping_admin":
        await page.goto(base)
        await page.get_by_placeholder("user name").fill(account["username"])
        await page.get_by_placeholder("password").fill(account["password"])
        button = page.get_by_role("button", name="Sign in")
    elif site == "gitlab":
        await page.goto(f"{base}/users/sign_in")
        await page.get_by_test_id("username-field").fill(account["username"])
        await page.get_by_test_id("password-field").fill(account["password"])
        button = page.get_by_test_id("sign-in-button")
    else:
        raise ValueError(f"no login for site {site}")
    async with page.expect_navigation():
        await button.click()
    if "login" in page.url or "sign_in" in page.url:
        raise RuntimeError(f"could not log in to {site} at {base} as {account['username']}")
