"""Measure built docs pages in a headless browser: horizontal overflow, and screenshots.

Run after the HTML build (``docs/build.sh`` does)::

    python docs/_ext/kfac_pagecheck.py docs/_build/html --screenshots docs/_build/screenshots

Every page of the build (each ``.html`` outside ``_static``-style folders, less the
generated index and search pages: :func:`all_pages`) is loaded in headless Chromium at a
laptop width (1280 px), after MathJax has typeset it, and fails the check when

* the main column (``article.bd-article``) is wider than its box (``scrollWidth >
  clientWidth``): something pushes the text column sideways;
* an element sticks out of the main column without sitting in a scrolling box of its own
  (tables in their scroll wrapper and ``pre`` blocks with ``overflow: auto`` are fine);
* a display formula is wider than its box (it would be clipped or need scrolling),
* a ``pre`` block is wider than its box and is not scrollable (its end would be cut off), or
* the left navigation is missing or has no links, the header needs more than one row, or a
  sidebar is wider than its box (the sidebars hide their horizontal overflow: navigation
  entries would be cut).

Code blocks that scroll are listed as notes, not failures.  A full-width screenshot (the top
``--max-height`` pixels) of each key page (``PAGES``; of every page with
``--screenshot-all``) is written as PNG.  Without a Chromium the check says
so and exits 0: the build does not depend on a browser being installed.

Chromium is driven through its DevTools protocol over a pipe (``--remote-debugging-pipe``:
JSON messages separated by NUL bytes on file descriptors 3 and 4), so nothing beyond the
standard library and the browser is needed.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Key pages (paths under the HTML root): screenshotted, and a page missing from the build is
# an error.  Every page of the build is measured.
PAGES = [
    "index.html",
    "quickstart.html",
    "conventions.html",
    "theory/kfc.html",
    "theory/series.html",
    "conformance/ecosystem.html",
    "conformance/findings.html",
    "api/generated/kfac_ref.linalg.html",
    "api/generated/kfac_ref.blocks.tf.ConvKFCBasicFB.html",
    "tutorials/plot_3_conv_factor_cost.html",
]
WIDTH = 1280
HEIGHT = 900
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]

# Runs in the page; returns the measurements as JSON.  An element "escapes" when its right
# edge passes the article's and no ancestor below the article scrolls or clips it in a box
# that itself fits.
MEASURE_JS = r"""
(() => {
  const art = document.querySelector('article.bd-article') || document.querySelector('main');
  if (!art) return JSON.stringify({error: 'no article.bd-article or main element'});
  const ar = art.getBoundingClientRect();
  const tol = 1;
  const scrolls = (el) => {
    const o = getComputedStyle(el).overflowX;
    return o === 'auto' || o === 'scroll' || o === 'hidden' || o === 'clip';
  };
  const describe = (el) => {
    let s = el.tagName.toLowerCase();
    if (el.id) s += '#' + el.id;
    if (el.classList.length) s += '.' + [...el.classList].slice(0, 3).join('.');
    const sec = el.closest('section[id]');
    return s + (sec ? ' in section #' + sec.id : '');
  };
  const text = (el) => (el.textContent || '').replace(/\s+/g, ' ').trim().slice(0, 90);
  const out = {article_width: art.clientWidth, scroll_width: art.scrollWidth,
               escaping: [], formulas: [], pre_cut: [], pre_scroll: [], formula_count: 0};
  // Inside a box of the column that scrolls or clips (the element itself too, for text).
  const contained = (el, self) => {
    for (let p = self ? el : el.parentElement; p && p !== art; p = p.parentElement) {
      if (scrolls(p) && p.getBoundingClientRect().right <= ar.right + tol) return true;
    }
    return false;
  };
  for (const el of art.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= ar.right + tol) continue;
    if (!contained(el, false)) {
      out.escaping.push({el: describe(el), right: Math.round(r.right - ar.right),
                         text: text(el)});
    }
  }
  // Text can run past the edge of its element (an unbreakable word in a narrow box).
  const walker = document.createTreeWalker(art, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const range = document.createRange();
    range.selectNodeContents(n);
    const r = range.getBoundingClientRect();
    if (r.width === 0 || r.right <= ar.right + tol || !n.parentElement) continue;
    if (!contained(n.parentElement, true)) {
      out.escaping.push({el: 'text in ' + describe(n.parentElement),
                         right: Math.round(r.right - ar.right), text: text(n.parentElement)});
    }
  }
  const maths = art.querySelectorAll('mjx-container[display="true"]');
  out.formula_count = maths.length;
  for (const m of maths) {
    const box = m.closest('div.math') || m;
    const svg = m.querySelector('svg');
    const need = Math.max(m.scrollWidth, svg ? svg.getBoundingClientRect().width : 0);
    const have = Math.min(m.clientWidth || box.clientWidth, box.clientWidth);
    if (need > have + tol) {
      let tex = text(box);
      try {  // the TeX source, from MathJax
        tex = MathJax.startup.document.getMathItemsWithin(m)[0].math.trim();
      } catch (e) { /* keep the rendered text */ }
      out.formulas.push({el: describe(box), need: Math.round(need), have: have,
                         tex: tex.replace(/\s+/g, ' ').slice(0, 160)});
    }
  }
  for (const pre of art.querySelectorAll('pre')) {
    if (pre.scrollWidth <= pre.clientWidth + tol) continue;
    const o = getComputedStyle(pre).overflowX;
    const item = {el: describe(pre), need: pre.scrollWidth, have: pre.clientWidth,
                  text: text(pre).slice(0, 60)};
    (o === 'auto' || o === 'scroll' ? out.pre_scroll : out.pre_cut).push(item);
  }
  // The header on one row (its three parts side by side), nothing wider than the sidebars.
  const parts = [...document.querySelectorAll('.bd-header .navbar-header-items__start, ' +
    '.bd-header .navbar-header-items__center, .bd-header .navbar-header-items__end')]
    .map((el) => el.getBoundingClientRect()).filter((r) => r.height > 0);
  // On one row, every part overlaps every other vertically.
  out.header_wraps = parts.length > 1 &&
    Math.max(...parts.map((r) => r.top)) >= Math.min(...parts.map((r) => r.bottom)) - 1;
  out.header_height = Math.round(document.querySelector('.bd-header')
    ?.getBoundingClientRect().height || 0);
  const nav = document.querySelector('.bd-sidebar-primary');
  out.nav_links = nav && nav.getBoundingClientRect().width > 0 ?
    [...nav.querySelectorAll('a[href]')].filter((a) => a.getClientRects().length).length : 0;
  out.sidebars = [];
  for (const sel of ['.bd-sidebar-primary', '.bd-sidebar-secondary']) {
    const sb = document.querySelector(sel);
    if (sb && sb.clientWidth && sb.scrollWidth > sb.clientWidth + tol) {
      out.sidebars.push({el: sel, need: sb.scrollWidth, have: sb.clientWidth});
    }
  }
  return JSON.stringify(out);
})()
"""

READY_JS = r"""
(async () => {
  await document.fonts.ready;
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  return Math.ceil(Math.max(document.documentElement.scrollHeight, document.body.scrollHeight));
})()
"""


#: pages of the build that are not documentation: Sphinx's generated index and search pages
NOT_PAGES = {"genindex.html", "search.html", "py-modindex.html"}


def all_pages(html: Path) -> list[str]:
    """Every documentation page under the HTML root ``html`` (paths relative to it): each
    ``.html`` file outside folders whose name starts with ``_`` (static files, sources,
    downloads), less :data:`NOT_PAGES`; sorted."""
    out = []
    for path in html.rglob("*.html"):
        rel = path.relative_to(html)
        if rel.as_posix() in NOT_PAGES or any(part.startswith("_") for part in rel.parts[:-1]):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def find_browser() -> str | None:
    env = os.environ.get("KFAC_DOCS_CHROMIUM")
    if env:
        return env
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """A headless Chromium spoken to over ``--remote-debugging-pipe``."""

    def __init__(self, executable: str, width: int = WIDTH, timeout: float = 60.0):
        self.width = width
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="kfac-docs-chromium-")
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def wire_fds():  # in the child: the browser reads commands on fd 3, answers on fd 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome_r, from_chrome_w)]
            for fd, target in zip(high, (3, 4), strict=True):
                os.dup2(fd, target)  # inheritable
                os.close(fd)

        self.proc = subprocess.Popen(
            [executable, *FLAGS, f"--window-size={width},{HEIGHT}",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire_fds, close_fds=False,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width,
                  height=HEIGHT, deviceScaleFactor=1, mobile=False)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer within {self.timeout:.0f} s")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        for i, ev in enumerate(self.events):
            if ev["method"] == method:
                return self.events.pop(i)
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._read_message(deadline)
            if msg.get("method") == method:
                return msg
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", session=True, expression=expression,
                        awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def load(self, url: str) -> int:
        """Open ``url``, wait for the load event, fonts and MathJax; return the page height."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")
        return int(self.evaluate(READY_JS))

    def screenshot(self, path: Path, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width,
                  height=height, deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width,
                  height=HEIGHT, deviceScaleFactor=1, mobile=False)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


def _measure(browser: Browser, url: str) -> tuple[int, dict]:
    """Load ``url``; return its height and the measurements of :data:`MEASURE_JS`."""
    height = browser.load(url)
    return height, json.loads(browser.evaluate(MEASURE_JS))


def problems(m: dict) -> list[str]:
    """The failures in one page's measurements, as sentences."""
    if "error" in m:
        return [m["error"]]
    out = []
    if m["scroll_width"] > m["article_width"] + 1:
        out.append(f"main column overflows: scrollWidth {m['scroll_width']} px > "
                   f"clientWidth {m['article_width']} px")
    for e in m["escaping"][:10]:
        out.append(f"{e['el']} sticks out {e['right']} px: {e['text']!r}")
    for f in m["formulas"]:
        out.append(f"display formula {f['need']} px wide in a {f['have']} px box "
                   f"({f['el']}): {f['tex']}")
    if not m.get("nav_links"):
        out.append("the left navigation is missing or empty")
    if m.get("header_wraps"):
        out.append(f"the header wraps onto more than one row ({m['header_height']} px high)")
    for sb in m.get("sidebars", []):
        out.append(f"{sb['el']} overflows: {sb['need']} px of content in {sb['have']} px")
    for p in m["pre_cut"]:
        out.append(f"code block cut ({p['need']} px in {p['have']} px, not scrollable, "
                   f"{p['el']}): {p['text']!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("html", type=Path, help="the HTML build directory")
    ap.add_argument("--screenshots", type=Path, help="write PNG screenshots here")
    ap.add_argument("--max-height", type=int, default=4000,
                    help="screenshot at most this many pixels of each page (default 4000)")
    ap.add_argument("--width", type=int, default=WIDTH,
                    help=f"window width in CSS pixels (default {WIDTH})")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds to wait for Chromium per step (default 120; a page that "
                         "times out is retried once in a fresh browser)")
    ap.add_argument("--verbose", "-v", action="store_true",
                    help="list every page, not only those that fail, note or are screenshotted")
    ap.add_argument("--screenshot-all", action="store_true",
                    help=f"screenshot every page checked (default: the {len(PAGES)} key pages)")
    ap.add_argument("pages", nargs="*", help="pages to check (default: every page of the "
                                             "build)")
    args = ap.parse_intermixed_args(argv)
    exe = find_browser()
    if exe is None:
        print("pagecheck: SKIPPED - no Chromium found (install Debian's `chromium`, or set "
              "KFAC_DOCS_CHROMIUM); the layout of the pages was not checked.")
        return 0
    pages = args.pages or all_pages(args.html)
    missing = [p for p in (args.pages or PAGES) if not (args.html / p).is_file()]
    if missing:
        print(f"pagecheck: FAILED - pages missing from the build: {', '.join(missing)}")
        return 1
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    failed = formulas = 0
    unmeasured = []
    try:
        browser = Browser(exe, width=args.width, timeout=args.timeout)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"pagecheck: FAILED - {exe} did not start a headless session: {exc}")
        return 1
    try:
        for page in pages:
            url = (args.html / page).resolve().as_uri()
            try:
                height, m = _measure(browser, url)
            except (RuntimeError, TimeoutError, OSError):
                # a busy machine: one more try in a fresh browser before giving up the page
                browser.close()
                browser = Browser(exe, width=args.width, timeout=args.timeout)
                try:
                    height, m = _measure(browser, url)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    print(f"pagecheck: FAIL {page}: not measured ({exc})")
                    unmeasured.append(page)
                    browser.close()
                    browser = Browser(exe, width=args.width, timeout=args.timeout)
                    continue
            bad = problems(m)
            shot = ""
            if args.screenshots and (args.screenshot_all or page in PAGES or args.pages):
                png = args.screenshots / (page.removesuffix(".html").replace("/", "__") + ".png")
                browser.screenshot(png, min(height, args.max_height))
                shot = f", screenshot {png}"
            status = "FAIL" if bad else "ok"
            formulas += m.get("formula_count", 0)
            notes = m.get("pre_scroll", [])
            if bad or shot or notes or args.verbose:  # a passing page is counted, not listed
                print(f"pagecheck: {status:4s} {page} (column {m.get('article_width')} px, "
                      f"{m.get('formula_count', 0)} display formulas{shot})")
            for line in bad:
                print(f"    {line}")
            for p in notes:
                print(f"    note: code block scrolls ({p['need']} px in {p['have']} px): "
                      f"{p['text']!r}")
            failed += bool(bad)
    finally:
        browser.close()
    if failed or unmeasured:
        print(f"pagecheck: FAILED - {len(pages) - len(unmeasured)} pages checked ({formulas} "
              f"display formulas), {failed} overflow at {args.width} px"
              + (f"; {len(unmeasured)} could not be measured (Chromium did not answer)"
                 if unmeasured else ""))
        return 1
    print(f"pagecheck: passed - {len(pages)} pages checked ({formulas} display formulas), 0 "
          f"overflow: every page fits the main column at {args.width} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
