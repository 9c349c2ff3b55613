"""Sphinx extension: render Markdown files that live outside ``docs/`` as pages.

``kfac_markdown_pages`` in ``conf.py`` maps a destination under ``docs/`` (git-ignored) to a
source file relative to the repository root, e.g.
``{"conformance/generated/README.md": "conformance/README.md"}``.  The files are copied at
``builder-inited`` (only when their content changed), so the repository keeps one copy of
each text, and MyST renders them.  Relative links between copied files keep working when
they are copied side by side.  A missing source file fails the build.
"""

from __future__ import annotations

from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _copy_pages(app):
    srcdir = Path(app.srcdir)
    root = srcdir.parent
    for dest, source in app.config.kfac_markdown_pages.items():
        src = root / source
        if not src.is_file():
            logger.warning(
                f"kfac_markdown_pages: {source} does not exist", type="kfac_markdown_pages"
            )
            continue
        target = srcdir / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        text = src.read_text(encoding="utf-8")
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")


def setup(app):
    app.add_config_value("kfac_markdown_pages", {}, "env")
    app.connect("builder-inited", _copy_pages, priority=400)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
