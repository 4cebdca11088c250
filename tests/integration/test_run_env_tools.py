"""The modes' environments for real: FTS5 search, the served web site, the py sandbox."""

from __future__ import annotations

import pytest
from support import bubblewrap

from rollfleet.envs.py import run_py_tests
from rollfleet.envs.rag import RagIndex
from rollfleet.envs.web import Browser, WebSite
from rollfleet.pool import SandboxLimits, SandboxProvider

pytestmark = pytest.mark.timeout(60)


def test_rag_search_ranks_the_right_document_first() -> None:
    index = RagIndex()
    try:
        hits = index.search("Who was the last keeper of the lighthouse?")
        assert hits[0].doc_id == "varrow-lighthouse" and hits[0].score > hits[-1].score
        assert index.search("ferry Grey Heron")[0].doc_id == "edsholm-ferry"
        assert index.search("?!") == [] and index.search("zzzqqq") == []
        assert "Agnes Moor" in (index.read("varrow-lighthouse") or "")
        assert index.read("nope") is None
    finally:
        index.close()


async def test_web_browser_open_click_find_back() -> None:
    site = WebSite().start()
    try:
        browser = Browser(site.url)
        home = await browser.open("/index.html")
        assert (
            home.startswith("Harbourside Books (/index.html)")
            and "[1] Catalogue -> /catalogue.html" in home
        )
        fiction = await browser.click("1")
        fiction = await browser.click("Fiction")
        assert "The Tide Clock" in fiction and browser.url.endswith("/books/fiction.html")
        book = await browser.click("Salt Letters")
        assert browser.find("pages") == "Pages: 198"
        assert "not on this page" in browser.find("dragon") and "Colm Dury" in book
        back = await browser.back()
        assert back.startswith("Fiction") and (await browser.click("nothing like it")).startswith(
            "error"
        )
        assert (await browser.open("http://example.com/")).startswith("error: only pages of")
        assert "HTTP 404" in await browser.open("/missing.html")
    finally:
        site.close()


async def test_py_reward_runs_the_tests_in_the_sandbox(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bubblewrap()
    provider = SandboxProvider(SandboxLimits(wall_s=3, test_s=2), root=tmp_path)
    sandbox = await provider.start("py-test")
    try:
        tests = ["add(2, 3) == 5", "add(-1, 1) == 0"]
        good = await run_py_tests(sandbox, "def add(a, b):\n    return a + b\n", tests)
        assert good.reward == 1.0 and good.correct and good.details["passed"] == 2
        half = await run_py_tests(sandbox, "def add(a, b):\n    return 5\n", tests)
        assert half.reward == 0.5 and not half.correct
        broken = await run_py_tests(sandbox, "def add(a, b) return", tests)
        assert broken.reward == 0.0 and "SyntaxError" in broken.details["import_error"]
        looping = await run_py_tests(sandbox, "while True:\n    pass\n", tests)
        assert looping.reward == 0.0
    finally:
        await provider.stop(sandbox)
