"""One Chromium per process, shared by every WebArena env, owned by one thread.

Playwright objects belong to the event loop that created them, but the rollout calls env.step from
a thread pool, a different thread each time. So a single daemon thread runs an asyncio loop that
owns Playwright, the browser and every browser context; an env submits a coroutine with
`BROWSER.run(coroutine, timeout)` from whatever thread it is on and waits for the result. Envs
therefore run concurrently inside the browser (each in its own isolated context) while no
Playwright object is ever touched from two threads.

Failures: a call that does not finish in time (a hung renderer, a page that never loads) is
cancelled and raises BrowserError; so does any call after the browser died. The next `browser()`
call launches a fresh Chromium (contexts of the dead one are gone; their envs make new ones on
their next reset). At exit the browser and the Playwright driver are closed, and any Chromium
process of ours still alive after that is killed, so none survives the run.

Chromium is the system one (`apt-get install chromium`), never a downloaded build; the path comes
from make(chromium=...), else $WEBARENA_CHROMIUM, else /usr/bin/chromium.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import signal
import threading
from pathlib import Path

DEFAULT_CHROMIUM = "/usr/bin/chromium"
# A closed network: no background traffic, updates, sync or QUIC; /tmp instead of a small /dev/shm.
LAUNCH_ARGS = [
    "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--disable-quic", "--disable-dev-shm-usage", "--disable-domain-reliability",
    "--disable-breakpad", "--metrics-recording-only", "--no-default-browser-check",
]


class BrowserError(RuntimeError):
    """The browser, a page or a site failed (not the model): the trajectory ends with this error."""


def chromium_path(path: str | None = None) -> str:
    path = path or os.environ.get("WEBARENA_CHROMIUM") or DEFAULT_CHROMIUM
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"Chromium not found at {path}: install it with `apt-get install -y chromium` "
            "or pass chromium=/path/to/chromium (or set WEBARENA_CHROMIUM)")
    return path


class Browser:
    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._playwright = None
        self._browser = None
        self._launching: asyncio.Lock | None = None
        self.executable: str | None = None
        self.launches = 0  # how many Chromiums this process started; an env's context belongs to one

    # -- called from any thread

    def run(self, coroutine, timeout: float):
        """Run `coroutine` on the browser thread; its result, or BrowserError after `timeout` s."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._ensure_loop())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BrowserError(f"the browser did not finish within {timeout:g} s (a hung page or site?)") from None

    def connected(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    def use(self, executable: str) -> None:
        with self._lock:
            if self.executable not in (None, executable):
                raise ValueError(f"this process already drives Chromium {self.executable}; one browser per process")
            self.executable = executable

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="webarena-browser").start()
                atexit.register(self.shutdown)
            return self._loop

    def shutdown(self) -> None:
        """Close the browser and Playwright; kill whatever of ours is left. Safe to call twice."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(15)
        except Exception:
            pass
        for pid in chromium_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        loop.call_soon_threadsafe(loop.stop)

    # -- coroutines, on the browser thread

    async def browser(self):
        """The live browser, launched (again) if there is none or it died."""
        if self._launching is None:
            self._launching = asyncio.Lock()
        async with self._launching:
            if self._browser is None or not self._browser.is_connected():
                await self._launch()
            return self._browser

    async def _launch(self) -> None:
        from playwright.async_api import async_playwright

        if self._browser is not None:  # dead: make sure nothing of it lingers
            try:
                await asyncio.wait_for(self._browser.close(), 5)
            except Exception:
                pass
            self._browser = None
        if self._playwright is None:
            self._playwright = await async_playwright().start()
        self._browser = await self._playwright.chromium.launch(
            executable_path=self.executable or chromium_path(), headless=True, args=LAUNCH_ARGS)
        self.launches += 1

    async def _close(self) -> None:
        if self._browser is not None:
            try:
                await asyncio.wait_for(self._browser.close(), 10)
            except Exception:
                pass
            self._browser = None
        if self._playwright is not None:
            try:
                await asyncio.wait_for(self._playwright.stop(), 5)
            except Exception:
                pass
            self._playwright = None


BROWSER = Browser()


# ----------------------------------------------------------------------------------------------
# Our processes, from /proc (for the exit clean-up, the fault tests and the benchmark)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int | None = None) -> list[int]:
    tree, out, todo = _children(), [], [pid or os.getpid()]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def chromium_pids(pid: int | None = None) -> list[int]:
    """The Chromium processes (browser and helpers) descended from this process."""
    out = []
    for child in descendants(pid):
        try:
            exe = os.readlink(f"/proc/{child}/exe")
        except OSError:
            continue
        if "chrom" in Path(exe).name:
            out.append(child)
    return out
