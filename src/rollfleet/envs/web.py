"""``web``: browse a small bundled website served on 127.0.0.1; exact match on the answer.

The site (``rollfleet/examples/web_site/``) is served by a :class:`WebSite` thread on a free
loopback port. Tools: ``open_url``, ``click`` (a link's number or text), ``find`` (lines of the
page containing some text) and ``back``. Pages are shown as text with numbered links.
Task: ``{"question": str, "answer": str, "start": "/index.html" (optional)}``.

What the model sees (the ``observation`` run option): ``text`` (default) the page as text;
``screenshot`` the page's title and path as text and the page rendered in headless Chromium as
an image part (:mod:`rollfleet.envs.web_render`); ``both`` the text and the screenshot.
Chromium starts only for the screenshot observations, once per served site.
"""

from __future__ import annotations

import functools
import http.server
import threading
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from rollfleet.envs.base import (
    EnvSpec,
    Observation,
    Score,
    StaticEnv,
    Tool,
    Transcript,
    handle_of,
    normalize_answer,
    require_fields,
)
from rollfleet.envs.web_render import LazyRenderer, Renderer
from rollfleet.errors import InvalidInput, PoolError

PAGE_LIMIT = 1500
OBSERVATIONS = ("text", "screenshot", "both")


def bundled_site() -> Path:
    """The directory of the website shipped with rollfleet."""
    return Path(str(resources.files("rollfleet.examples").joinpath("web_site")))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log."""


class WebSite:
    """Serves a directory of HTML pages on a free loopback port, on a daemon thread."""

    def __init__(self, root: str | Path | None = None) -> None:
        """Serve ``root`` (the bundled site by default); call start()."""
        self.root = Path(root) if root else bundled_site()
        if not (self.root / "index.html").is_file():
            raise InvalidInput(f"{self.root}: a web site directory needs an index.html")
        handler = functools.partial(_Quiet, directory=str(self.root))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rollfleet-web", daemon=True
        )
        self._renderer = LazyRenderer()

    def renderer(self) -> Renderer:
        """The site's Chromium renderer, started at the first call."""
        return self._renderer.get()

    def start(self) -> WebSite:
        """Start serving."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving (and Chromium, if it started)."""
        self._renderer.close()
        self._server.shutdown()
        self._server.server_close()


class _Page(HTMLParser):
    """Visible text and links of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.title, self.lines, self.links = "", [""], []  # type: ignore[var-annotated]
        self._href: str | None = None
        self._anchor: list[str] = []
        self._skip = self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Track links, titles and block boundaries."""
        if tag in ("script", "style"):
            self._skip = True
        elif tag == "title":
            self._in_title = True
        elif tag == "a":
            self._href, self._anchor = dict(attrs).get("href"), []
        if tag in ("p", "li", "h1", "h2", "h3", "tr", "br", "div", "dt", "dd"):
            self.lines.append("")

    def handle_endtag(self, tag: str) -> None:
        """Close links and skipped blocks."""
        if tag in ("script", "style"):
            self._skip = False
        elif tag == "title":
            self._in_title = False
        elif tag == "a" and self._href is not None:
            text = " ".join("".join(self._anchor).split())
            self.links.append((text, self._href))
            self.lines[-1] += f" [{len(self.links)}]"
            self._href = None

    def handle_data(self, data: str) -> None:
        """Collect visible text."""
        if self._in_title:
            self.title += data.strip()
        elif not self._skip:
            self.lines[-1] += data.replace("\n", " ")
            if self._href is not None:
                self._anchor.append(data)

    def text_lines(self) -> list[str]:
        """Non-empty lines of text."""
        return [" ".join(line.split()) for line in self.lines if line.strip()]


class Browser:
    """One rollout's browser: a current page, its links and a history."""

    def __init__(self, site_url: str) -> None:
        """Browse the site at ``site_url``."""
        self.site_url = site_url
        self.url: str | None = None
        self.page: _Page | None = None
        self.history: list[str] = []

    async def open(self, url: str, *, remember: bool = True) -> str:
        """Load ``url`` (absolute or relative to the current page or the site) and show it."""
        target = urljoin(self.url or self.site_url + "/", url)
        if urlsplit(target).netloc != urlsplit(self.site_url).netloc:
            return f"error: only pages of {self.site_url} can be opened"
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(target)
        if response.status_code != 200:
            return f"error: {target} answered HTTP {response.status_code}"
        if remember and self.url is not None:
            self.history.append(self.url)
        page = _Page()
        page.feed(response.text)
        self.url, self.page = target, page
        return self.show()

    def show(self) -> str:
        """The current page as text with numbered links."""
        if self.page is None:
            return "no page is open"
        body = "\n".join(self.page.text_lines())[:PAGE_LIMIT]
        links = "\n".join(
            f"[{i}] {text} -> {href}" for i, (text, href) in enumerate(self.page.links, 1)
        )
        return f"{self.page.title} ({urlsplit(self.url or '').path})\n{body}\nLinks:\n{links}"

    async def click(self, link: str) -> str:
        """Follow a link given by its number or (part of) its text."""
        if self.page is None:
            return "error: no page is open"
        links = self.page.links
        key = link.strip().strip("[]")
        if key.isdigit() and 1 <= int(key) <= len(links):
            return await self.open(links[int(key) - 1][1])
        for text, href in links:
            if key and key.lower() in text.lower():
                return await self.open(href)
        return f"error: no link {link!r} on this page"

    def find(self, text: str) -> str:
        """Lines of the current page that contain ``text`` (case-insensitive)."""
        if self.page is None:
            return "error: no page is open"
        hits = [line for line in self.page.text_lines() if text.lower() in line.lower()]
        return "\n".join(hits) if hits else f"{text!r} is not on this page"

    async def back(self) -> str:
        """Return to the previous page."""
        if not self.history:
            return "error: there is no previous page"
        return await self.open(self.history.pop(), remember=False)


def web_reward(answer: str, gold: str) -> Score:
    """1.0 on an exact match after normalisation."""
    exact = normalize_answer(answer) == normalize_answer(gold)
    return Score(reward=float(exact), correct=exact, details={"expected": gold})


class WebSession:
    """Browses the served site."""

    def __init__(self, task: dict[str, Any], site: WebSite, observation: str = "text") -> None:
        """Browse ``site`` for ``task``, showing the model ``observation``."""
        self.site, self.observation = site, observation
        self.tools = [
            Tool(
                "open_url",
                "open a page of the site",
                {"url": "a URL or a path such as /index.html"},
            ),
            Tool(
                "click", "follow a link on the current page", {"link": "the link's number or text"}
            ),
            Tool(
                "find",
                "show the lines of the current page containing some text",
                {"text": "what to look for"},
            ),
            Tool("back", "go back to the previous page"),
        ]
        self.task, self.browser = task, Browser(site.url)

    async def call(self, name: str, args: dict[str, Any]) -> str | Observation:
        """Run one browser tool (with a screenshot of the page it opened, when asked)."""
        try:
            if name == "open_url":
                text = await self.browser.open(str(args.get("url", "/index.html")))
            elif name == "click":
                text = await self.browser.click(str(args.get("link", "")))
            elif name == "find":
                return self.browser.find(str(args.get("text", "")))
            elif name == "back":
                text = await self.browser.back()
            else:
                return f"error: unknown tool {name!r}; the tools are open_url, click, find, back"
        except httpx.HTTPError as exc:
            return f"error: {exc}"
        if self.observation == "text" or text.startswith("error:") or self.browser.url is None:
            return text
        png = await self.site.renderer().screenshot(self.browser.url)
        if self.observation == "screenshot":
            page = self.browser.page
            title = page.title if page is not None else ""
            text = f"{title} ({urlsplit(self.browser.url).path}); its screenshot follows"
        return Observation(text, (png,))

    async def score(self, answer: str, transcript: Transcript | None = None) -> Score:
        """Exact match against the task's answer."""
        return web_reward(answer, str(self.task["answer"]))


class WebMode:
    """Questions answered by browsing the bundled site."""

    name = "web"
    uses_tools = True
    observations = OBSERVATIONS
    shares_process = False  # its browser runs beside the rollout: one runner process each

    def __init__(self, observation: str | None = None) -> None:
        """Show the model ``observation`` (``text``, ``screenshot`` or ``both``; default text)."""
        observation = observation or "text"
        if observation not in OBSERVATIONS:
            raise InvalidInput(
                f"web: observation {observation!r}; the observations are {', '.join(OBSERVATIONS)}"
            )
        self.observation = observation

    def check(self, task: Any, where: str) -> None:
        """``question``, ``answer`` and an optional ``start`` path."""
        require_fields(task, where, {"question": str, "answer": str})
        start = task.get("start", "/index.html")
        if not isinstance(start, str) or not start.startswith("/"):
            raise InvalidInput(
                f"{where}: field 'start' must be a path starting with '/', got {start!r}"
            )

    def system_prompt(self, task: dict[str, Any]) -> str:
        """Explain browsing."""
        seen = {
            "text": "",
            "screenshot": " You see each page you open as a screenshot.",
            "both": " You see each page you open as text and as a screenshot.",
        }[self.observation]
        return (
            "You answer questions by browsing a small website. Open pages, click links and "
            f"find text; then give only the short answer.{seen}"
        )

    def user_prompt(self, task: dict[str, Any]) -> str:
        """The question and the start page."""
        return f"{task['question']}\nStart at {task.get('start', '/index.html')}."

    async def open(self, task: dict[str, Any], env: Any) -> WebSession:
        """A session browsing the runner's site."""
        site = handle_of(env)
        if not isinstance(site, WebSite):
            raise PoolError("web mode needs the served site as ctx.env")
        return WebSession(task, site, self.observation)

    def env_source(self, spec: EnvSpec, concurrency: int) -> StaticEnv:
        """The site, served once per runner process."""
        site = WebSite(spec.site).start()
        return StaticEnv(site, "web", endpoint=site.url, on_close=site.close)

    def preflight(self, spec: EnvSpec, local: bool) -> None:
        """Screenshots need the machine's Chromium."""
        if local and self.observation in ("screenshot", "both"):
            from rollfleet.envs.web_render import find_chromium

            find_chromium()
