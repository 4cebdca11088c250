"""Screenshots of web pages in headless Chromium, for ``web`` agents that work on pixels.

:class:`Renderer` drives the machine's Chromium (Debian's ``/usr/bin/chromium``, or
``ROLLFLEET_CHROMIUM``) through Playwright's sync API on one thread of its own, so the asyncio
rollouts of a runner share one browser; it never downloads a browser. Chromium starts at the
first screenshot and stops at :meth:`Renderer.close`. :func:`find_chromium` makes a missing
Chromium or Playwright one clear PoolError.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollfleet.errors import PoolError

CHROMIUM_ARGS = [  # headless, and nothing fetched or updated behind the page's back
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
VIEWPORT = (1024, 768)
LOAD_TIMEOUT_MS = 15_000


def find_chromium() -> str:
    """The Chromium binary to drive (``ROLLFLEET_CHROMIUM``, else ``chromium`` on PATH, else
    /usr/bin/chromium); PoolError saying what to install when it or Playwright is missing."""
    path = os.environ.get("ROLLFLEET_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        raise PoolError(
            f"web screenshots need Chromium, and there is none at {path}: install it "
            "(apt-get install chromium) or set ROLLFLEET_CHROMIUM to its binary"
        )
    if importlib.util.find_spec("playwright") is None:
        raise PoolError("web screenshots need Playwright: pip install playwright")
    return path


class Renderer:
    """One headless Chromium on a thread of its own; :meth:`screenshot` renders a URL."""

    def __init__(self, executable: str | None = None, viewport: tuple[int, int] = VIEWPORT) -> None:
        """Drive ``executable`` (found by :func:`find_chromium` when None) at ``viewport``."""
        self.executable = executable or find_chromium()
        self.viewport = {"width": viewport[0], "height": viewport[1]}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rollfleet-chromium")
        self._playwright: Any = None
        self._browser: Any = None

    def _shot(self, url: str) -> bytes:
        if self._browser is None:
            from playwright.sync_api import sync_playwright

            self._playwright = sync_playwright().start()
            self._browser = self._playwright.chromium.launch(
                executable_path=self.executable, args=CHROMIUM_ARGS
            )
        page = self._browser.new_page(viewport=self.viewport)
        try:
            page.goto(url, wait_until="load", timeout=LOAD_TIMEOUT_MS)
            return bytes(page.screenshot(type="png"))
        finally:
            page.close()

    async def screenshot(self, url: str) -> bytes:
        """A PNG of the page at ``url`` as Chromium shows it (the top of the page)."""
        try:
            return await asyncio.wrap_future(self._thread.submit(self._shot, url))
        except PoolError:
            raise
        except Exception as exc:  # Playwright's errors: a browser that did not start or crashed
            raise PoolError(f"Chromium could not render {url}: {exc}") from exc

    def _stop(self) -> None:
        if self._browser is not None:
            self._browser.close()
            self._playwright.stop()
            self._browser = self._playwright = None

    def close(self) -> None:
        """Stop Chromium (if it started) and the thread."""
        self._thread.submit(self._stop).result(timeout=30)
        self._thread.shutdown()


class LazyRenderer:
    """A Renderer made at the first call, shared by whoever holds this (thread-safe)."""

    def __init__(self) -> None:
        """Nothing starts yet."""
        self._lock = threading.Lock()
        self._renderer: Renderer | None = None

    def get(self) -> Renderer:
        """The renderer, made now if this is the first call."""
        with self._lock:
            if self._renderer is None:
                self._renderer = Renderer()
            return self._renderer

    def close(self) -> None:
        """Close the renderer if one was made."""
        with self._lock:
            if self._renderer is not None:
                self._renderer.close()
                self._renderer = None
