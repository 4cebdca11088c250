"""Fixtures of the dashboard's browser tests: one headless Chromium per module, and a fresh page
that fails its test if it logged any console error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from acceptance.dashboard_browser import CHROMIUM_ARGS, WAIT_MS, Browser, Page, sync_playwright
from support import chromium_path, require


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    require(sync_playwright is not None, "playwright (pip install playwright)")
    path = chromium_path()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page; the test fails if any page it opened logged a console error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(WAIT_MS)
    yield pg
    context.close()  # closes the event stream before the server stops
    assert errors == [], f"console errors: {errors}"
