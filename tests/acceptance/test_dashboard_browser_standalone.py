"""The dashboard in headless Chromium on servers of its own: no batches, pools or engines
configured; ids that share a long prefix; the token login form."""

from __future__ import annotations

from pathlib import Path

from acceptance.dashboard_browser import WAIT_MS, Browser, Page, expect, row, wait_live

from rollfleet.client import connect_sync
from rollfleet.server.dashboard import dashboard_router
from rollfleet.server.embedded import ServerThread
from rollfleet.server.parts import ServerParts


def test_pages_without_extras_say_none_configured(tmp_path: Path, page: Page) -> None:
    url = f"sqlite:///{tmp_path / 'bare.db'}"
    with ServerThread(
        url, parts=lambda store: ServerParts(routers=[("", dashboard_router(store))])
    ) as srv:
        page.goto(f"{srv.url}/#/batches")
        expect(page.locator("#batches-none")).to_have_text("No batches configured on this server.")
        page.goto(f"{srv.url}/#/pools")
        expect(page.locator("#pools-none")).to_be_visible()
        expect(page.locator("#engines-none")).to_be_visible()
        page.goto(f"{srv.url}/#/runners")
        expect(page.locator("#runners")).to_contain_text("No worker has registered yet")
        page.close()  # the event stream ends before the server stops


def test_ids_sharing_a_long_prefix_show_the_part_that_differs(tmp_path: Path, page: Page) -> None:
    """Ids made together share their start: rows show the tails, the whole id on hover."""
    from rollfleet.model import RolloutSpec

    stem = "ro-019ab2c4d5e6f1a2b3c4"  # the same millisecond, even the same start of the random part
    ids = [f"{stem}d5e6f7a8", f"{stem}9f3c2a1b"]
    workers = ["gpu-node-0001.cluster.example-4242-0", "gpu-node-0001.cluster.example-4242-1"]
    url = f"sqlite:///{tmp_path / 'ids.db'}"
    with ServerThread(
        url, parts=lambda store: ServerParts(routers=[("", dashboard_router(store))])
    ) as srv:
        client = connect_sync(srv.url)
        try:
            client.enqueue_many([RolloutSpec(input=i, rollout_id=rid) for i, rid in enumerate(ids)])
            for worker, rid in zip(workers, ids, strict=True):
                client.register_worker(worker)
                assert [r.rollout_id for r in client.claim(worker)] == [rid]
        finally:
            client.close()
            client._loop.close()
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=srv.url)
        page.goto(f"{srv.url}/#/rollouts")
        links = [row(page, rid).locator("td").nth(0).locator("a") for rid in ids]
        cells = [row(page, rid).locator("td").nth(5).locator(".mono") for rid in ids]  # worker
        for rid, worker, link, cell in zip(ids, workers, links, cells, strict=True):
            expect(link).to_have_attribute("title", rid)
            expect(link).to_contain_text(rid[-8:])
            expect(cell).to_have_attribute("title", worker)
        assert links[0].inner_text() != links[1].inner_text()
        assert cells[0].inner_text() != cells[1].inner_text()
        row(page, ids[1]).locator("td").nth(0).locator("button.copy").click()
        expect(page.locator(".toast.ok")).to_contain_text(f"Copied {ids[1]}")
        assert page.evaluate("navigator.clipboard.readText()") == ids[1]

        page.goto(f"{srv.url}/#/runners")
        shown = []
        for worker, rid in zip(workers, ids, strict=True):
            tr = page.locator(f'#runners tr[data-worker="{worker}"]')
            name, current = tr.locator("td").nth(0).locator(".mono"), tr.locator("td.current a")
            expect(name).to_have_attribute("title", worker)
            expect(current).to_have_attribute("title", rid)
            expect(current).to_contain_text(rid[-8:])
            shown.append((name.inner_text(), current.inner_text()))
        assert shown[0][0] != shown[1][0] and shown[0][1] != shown[1][1]
        page.close()  # the event stream ends before the server stops


def test_token_login_form_and_query_param(tmp_path: Path, browser: Browser) -> None:
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    with ServerThread(
        url,
        token="s3cret",
        parts=lambda store: ServerParts(routers=[("", dashboard_router(store))]),
    ) as srv:
        context = browser.new_context()
        pg = context.new_page()
        pg.set_default_timeout(WAIT_MS)
        errors: list[str] = []
        pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        pg.goto(f"{srv.url}/#/runners")
        expect(pg.locator("form.login")).to_be_visible()
        pg.locator("#token").fill("wrong")
        pg.locator("form.login button").click()
        expect(pg.locator("form.login .error")).to_have_text("That token was refused.")
        pg.locator("#token").fill("s3cret")
        pg.locator("form.login button").click()
        expect(pg.locator("#runners")).to_contain_text("No worker has registered yet")
        wait_live(pg)
        fresh = context.new_page()
        fresh.goto(f"{srv.url}/?token=s3cret#/rollouts")
        expect(fresh.locator("#rollout-rows")).to_contain_text("No rollout matches")
        assert "token" not in fresh.url
        assert fresh.evaluate("sessionStorage.getItem('rollfleet.token')") == "s3cret"
        context.close()
    assert errors and all("401" in e for e in errors), errors  # only the refused requests
