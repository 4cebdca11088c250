"""What the dashboard's browser tests share besides their fixtures (in conftest.py): Chromium's
flags, screenshots for the docs, and locators of the live pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: F401 (re-exported)
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None  # type: ignore[assignment]

from rollfleet.envs.web_render import CHROMIUM_ARGS  # noqa: E402,F401 (re-exported)

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "screenshots"
WAIT_MS = 20_000


def shot(page: Page, name: str) -> None:
    """Save a screenshot for the docs."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def wait_live(page: Page) -> None:
    expect(page.locator("#live")).to_have_text("live")


def row(page: Page, rollout_id: str) -> Any:
    return page.locator(f'#rollout-rows tr[data-id="{rollout_id}"]')
