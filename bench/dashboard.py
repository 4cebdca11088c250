"""Dashboard benchmark: Rollouts page first paint with 1,000 and 10,000 rollouts, side by side.

For each store size a real server is started, and headless Chromium opens the Rollouts page in a
fresh browser context (no cache) several times. Figures: first-contentful-paint from the
Performance API, the time until the table's first rows are rendered (a ``rollouts-rendered``
performance mark the page sets), and, for comparison, what rendering every rollout at once would
cost (fetch all pages and build all rows in the same page). Also: how long a store write takes
to show on screen through the live event stream. Target: first paint and first rows under 1 s.

Run: ``python -m bench.dashboard`` (needs /usr/bin/chromium and playwright).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollfleet.envs.web_render import CHROMIUM_ARGS
from rollfleet.model import AttemptStatus, RolloutResult, RolloutSpec
from rollfleet.server.dashboard import dashboard_router, live
from rollfleet.server.embedded import ServerThread
from rollfleet.server.parts import ServerParts
from rollfleet.store import open_sql_store

RESULTS = Path(__file__).parent / "results" / "dashboard.json"
SIZES = (1_000, 10_000)
RUNS = 7
LIVE_WRITES = 15
RENDER_ALL_JS = """async () => {
  const t0 = performance.now();
  let cursor = null, rows = 0;
  const tbody = document.createElement('tbody');
  do {
    const q = cursor ? `&cursor=${cursor}` : '';
    const page = await (await fetch(`/dashboard/api/rollouts?limit=500${q}`)).json();
    for (const r of page.items) {
      const tr = document.createElement('tr');
      for (const v of [r.rollout_id, r.status, r.mode, r.batch_id, r.attempts, r.worker_id, r.reward]) {
        const td = document.createElement('td'); td.textContent = v ?? '-'; tr.append(td);
      }
      tbody.append(tr); rows++;
    }
    cursor = page.next_cursor;
  } while (cursor);
  document.querySelector('table.rollouts').append(tbody);
  await new Promise(requestAnimationFrame);
  return {ms: performance.now() - t0, rows};
}"""


async def _seed(path: Path, n: int) -> None:
    """n rollouts: 60% succeeded with rewards, 10% failed, the rest queued."""
    store = open_sql_store(f"sqlite:///{path}")
    try:
        for start in range(0, n, 2000):
            await store.enqueue_many(
                [
                    RolloutSpec(
                        input={"task": i, "prompt": f"Task {i}"},
                        mode=("math", "py")[i % 2],
                        batch_id=f"batch-{i // 500}",
                    )
                    for i in range(start, min(n, start + 2000))
                ]
            )
        await store.register_worker("bench-worker")
        finished = 0
        while finished < int(n * 0.7):
            for r in await store.claim("bench-worker", max_n=min(500, int(n * 0.7) - finished)):
                assert r.attempt is not None
                fail = finished % 7 == 0
                await store.complete(
                    r.attempt.attempt_id,
                    AttemptStatus.FAILED if fail else AttemptStatus.SUCCEEDED,
                    None if fail else RolloutResult(reward=(finished % 10) / 10),
                    "boom" if fail else None,
                )
                finished += 1
    finally:
        await store.close()


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 1)


def _measure_paint(browser: Any, url: str) -> dict[str, Any]:
    fcp, rows_ms, all_ms = [], [], []
    for i in range(RUNS):
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        page.goto(f"{url}/#/rollouts")
        page.wait_for_selector("#rollout-rows tr[data-id]")
        page.wait_for_function("performance.getEntriesByName('first-contentful-paint').length > 0")
        timing = page.evaluate("""() => ({
            fcp: performance.getEntriesByName('first-contentful-paint')[0].startTime,
            rows: performance.getEntriesByName('rollouts-rendered')[0].startTime })""")
        if i > 0:  # the first run warms the server's caches and the OS page cache
            fcp.append(timing["fcp"])
            rows_ms.append(timing["rows"])
            result = page.evaluate(RENDER_ALL_JS)
            all_ms.append(result["ms"])
            rows_all = result["rows"]
        context.close()
    return {
        "fcp_ms_median": _median(fcp),
        "fcp_ms_max": round(max(fcp), 1),
        "first_rows_ms_median": _median(rows_ms),
        "first_rows_ms_max": round(max(rows_ms), 1),
        "render_all_ms": _median(all_ms),
        "render_all_rows": rows_all,
        "runs": len(fcp),
    }


def _measure_live(browser: Any, url: str) -> dict[str, Any]:
    from rollfleet.client import connect_sync

    store = connect_sync(url)
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{url}/#/rollouts?mode=live")
    page.wait_for_selector("#live:text('live')")
    page.evaluate("""() => { window.__seen = {};
      new MutationObserver(() => { for (const tr of document.querySelectorAll('#rollout-rows tr[data-id]'))
        if (!window.__seen[tr.dataset.id + tr.dataset.status]) window.__seen[tr.dataset.id + tr.dataset.status] = Date.now(); })
        .observe(document.getElementById('rollout-rows'), {childList: true, subtree: true}); }""")
    lags = []
    try:
        for _ in range(LIVE_WRITES):
            time.sleep(
                live.MIN_INTERVAL_S + 0.05
            )  # past the coalescing window: the pipeline's own latency
            t0 = time.time()
            rid = store.enqueue_rollout({"live": True}, mode="live").rollout_id
            page.wait_for_function(f"window.__seen['{rid}queuing'] !== undefined")
            lags.append(page.evaluate(f"window.__seen['{rid}queuing']") - t0 * 1000)
            store.cancel(rid)
    finally:
        context.close()
        store.close()
        store._loop.close()
    return {
        "write_to_screen_ms_median": _median(lags),
        "write_to_screen_ms_max": round(max(lags), 1),
        "writes": len(lags),
    }


def _chromium() -> str | None:
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )


def main() -> dict[str, Any]:
    """Run the whole comparison, print a table, write bench/results/dashboard.json."""
    from playwright.sync_api import sync_playwright

    console = Console()
    load_before = os.getloadavg()[0]  # other work on the machine shows in the figures: record it
    chromium = _chromium()
    if chromium is None:
        raise SystemExit(
            "bench.dashboard needs Chromium at /usr/bin/chromium (apt-get install chromium)"
        )
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dbs = {}
        for (
            n
        ) in SIZES:  # seed before Playwright starts: its sync API holds this thread's event loop
            dbs[n] = Path(tmp) / f"fleet-{n}.db"
            started = time.perf_counter()
            asyncio.run(_seed(dbs[n], n))
            console.print(f"seeded {n:,} rollouts in {time.perf_counter() - started:.1f} s")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            version = browser.version
            for n in SIZES:
                with ServerThread(
                    f"sqlite:///{dbs[n]}",
                    parts=lambda s: ServerParts(routers=[("", dashboard_router(s))]),
                ) as srv:
                    figures[str(n)] = _measure_paint(browser, srv.url)
                    if n == max(SIZES):
                        figures["live"] = _measure_live(browser, srv.url)
            browser.close()
    small, big = figures[str(SIZES[0])], figures[str(SIZES[-1])]
    result = {
        "bench": "dashboard",
        "command": "python -m bench.dashboard",
        "figures": figures,
        "ratios": {
            "first_rows_10k_over_1k": round(
                big["first_rows_ms_median"] / small["first_rows_ms_median"], 2
            ),
            "render_all_over_paged_10k": round(
                big["render_all_ms"] / big["first_rows_ms_median"], 1
            ),
        },
        "target": {
            "first_paint_ms": 1000,
            "met": big["fcp_ms_max"] < 1000 and big["first_rows_ms_max"] < 1000,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_average_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "chromium": version,
        },
    }
    _print(console, result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print(console: Console, result: dict[str, Any]) -> None:
    table = Table(title="Rollouts page, headless Chromium (ms; median / max of the warm runs)")
    table.add_column("rollouts in store")
    for col in (
        "first contentful paint",
        "first rows rendered",
        "render all rows at once (median)",
    ):
        table.add_column(col, justify="right")
    for n in SIZES:
        f = result["figures"][str(n)]
        table.add_row(
            f"{n:,}",
            f"{f['fcp_ms_median']} / {f['fcp_ms_max']}",
            f"{f['first_rows_ms_median']} / {f['first_rows_ms_max']}",
            f"{f['render_all_ms']} ({f['render_all_rows']:,} rows)",
        )
    console.print(table)
    lag = result["figures"]["live"]
    console.print(
        f"live: store write → row on screen {lag['write_to_screen_ms_median']} ms median, "
        f"{lag['write_to_screen_ms_max']} ms max over {lag['writes']} writes (pushed by SSE, no polling; "
        f"bursts are coalesced to one push per {live.MIN_INTERVAL_S * 1000:.0f} ms)"
    )
    console.print(f"ratios: {result['ratios']}  target met: {result['target']['met']}")


if __name__ == "__main__":
    main()
