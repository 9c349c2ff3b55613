"""Sphinx configuration of the kfac_ref documentation.

Build (warnings are errors; the API check is part of the build):

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
    python -m sphinx -W --keep-going -n -b doctest docs docs/_build/doctest

Everything works offline: MathJax is shipped in ``_static/mathjax`` and no intersphinx
inventories are fetched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the kfac_ref checkout being documented
sys.path.insert(0, str(DOCS / "_ext"))

import kfac_ref  # noqa: E402

# -- Project -----------------------------------------------------------------------------
project = "kfac_ref"
author = "kfac_ref developers"
copyright = "kfac_ref developers"  # noqa: A001
release = kfac_ref.__version__
version = ".".join(release.split(".")[:2])

# -- API reference -----------------------------------------------------------------------
# Every public module of these packages (no dotted component starting with "_") gets a page
# generated from its __all__ (docs/_ext/kfac_apidoc.py); the build fails when a public
# function or class has no docstring or no formula in it.
kfac_api_packages = ["kfac_ref"]
# Order of the module pages.  A public module missing here still gets a page, after its
# siblings (kfac_api_autodiscover); add one line to place it.  Listed modules must exist.
kfac_api_modules = [
    "kfac_ref",
    "kfac_ref.linalg",
    "kfac_ref.averaging",
    "kfac_ref.patches",
    "kfac_ref.conv_geometry",
    "kfac_ref.factors",
    "kfac_ref.losses",
    "kfac_ref.nn",
    "kfac_ref.blocks",
    "kfac_ref.blocks.tf",
    "kfac_ref.blocks.kfac_jax",
    "kfac_ref.curvature",
]
kfac_api_autodiscover = True
# True also requires docstrings on public constants, methods and properties.
kfac_api_strict = True

# -- Extensions --------------------------------------------------------------------------
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
    "numpydoc",
    "sphinxcontrib.bibtex",
    "sphinx_gallery.gen_gallery",
    "myst_parser",
    "kfac_apidoc",
    "kfac_markdown_pages",
    "kfac_matrix",
    "kfac_support",
]

exclude_patterns = ["_build", "_static", "**.ipynb_checkpoints", "tutorials_src"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}

# The conformance suite documents itself in Markdown next to its code; these files are
# copied into docs/ at build time (git-ignored) and rendered by MyST, so they exist once.
kfac_markdown_pages = {
    "conformance/generated/README.md": "conformance/README.md",
    "conformance/generated/GOLDEN_SPEC.md": "conformance/GOLDEN_SPEC.md",
    "generated/CONTRIBUTING.md": "CONTRIBUTING.md",
}
# The ecosystem matrix (docs/_ext/kfac_matrix.py): drawn at build time from the suite's
# matrix.json (path relative to the repository root) into a git-ignored folder of docs/, and
# its table cells coloured by outcome on these pages.
kfac_matrix_json = "conformance/peers/reports/matrix.json"
kfac_matrix_figures = "conformance/generated"
kfac_matrix_pages = ["conformance/ecosystem"]
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]
root_doc = "index"
nitpicky = True
# No intersphinx (the build is offline): names of other libraries stay unlinked.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(numpy|abc|typing|collections|dataclasses|array_api_strict|array_api_compat"
        r"|torch|cupy|jax|builtins)(\..*)?",
    ),
    (
        r"py:.*",
        r"(ValueError|TypeError|Exception|BaseException|float|int|str|bool|tuple"
        r"|list|dict|object|None|callable)",
    ),
]

# autodoc / autosummary: pages are written by kfac_apidoc, autosummary only draws tables.
autosummary_generate = False
autodoc_typehints = "none"  # types are in the numpydoc "Parameters" sections
autodoc_member_order = "bysource"
toc_object_entries_show_parents = "hide"  # "update", not "kfac_ref.x.Y.update", in page TOCs
autodoc_default_options = {"exclude-members": "__init__, __new__"}

# numpydoc renders the docstrings; member tables come from autodoc's :members:.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

# Bibliography.
bibtex_bibfiles = ["references.bib"]
bibtex_default_style = "plain"
bibtex_reference_style = "author_year"

# MathJax shipped in the repository (npm mathjax@3.2.2, es5/tex-svg.js); a relative
# mathjax_path is resolved against _static/.
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {
    # textmacros (shipped next to tex-svg.js) makes \_ and friends work inside \text{} and
    # \texttt{}, which the docstrings use for argument names such as has\_bias.
    "loader": {"load": ["[tex]/textmacros"]},
    "tex": {
        "packages": {"[+]": ["textmacros"]},
        "macros": {
            "vecr": [r"\operatorname{vec}_r", 0],
            "vecc": [r"\operatorname{vec}_c", 0],
            "tr": [r"\operatorname{tr}", 0],
            "diag": [r"\operatorname{diag}", 0],
        },
    },
    "svg": {"fontCache": "global"},
}

# Tutorials: executed at every build (sphinx-gallery), plots embedded.
sphinx_gallery_conf = {
    "examples_dirs": ["tutorials_src"],
    "gallery_dirs": ["tutorials"],
    "filename_pattern": r"/plot_",
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
    "plot_gallery": "True",
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "show_memory": False,
    "min_reported_time": 10**6,
    "write_computation_times": False,
}

# Doctest builder: every ``>>>`` block of the pages and of the rendered docstrings runs.
doctest_global_setup = """
import numpy as np
import kfac_ref
"""

# -- HTML --------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"kfac_ref {release}"
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["kfac_ref.css"]
html_theme_options = {
    "navigation_with_keys": False,
    # The header names the four sections of the site (_templates/navbar-sections.html:
    # Guides, API, Conformance, Benchmarks), the captions of the root toctrees; the left
    # sidebar lists every page under them.
    "navbar_center": ["navbar-sections"],
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    # The search as an icon: with the field, eight header links do not fit one row at 1280 px.
    "navbar_persistent": [],
    "navbar_end": ["search-button", "theme-switcher"],
}
# The whole site in the left sidebar on every page (_templates/sidebar-site-nav.html).
html_sidebars = {"**": ["sidebar-site-nav"]}
html_show_sourcelink = False
html_copy_source = False

os.environ.setdefault("MPLBACKEND", "Agg")


def setup(app):
    # JSON with comments (used by conformance/GOLDEN_SPEC.md): the JavaScript lexer reads it.
    from pygments.lexers import JavascriptLexer

    app.add_lexer("jsonc", JavascriptLexer)
