"""Sphinx configuration of haiku_bridge's documentation site.

The site is the repository's Markdown as it is (the README, the guides of
docs/, the changelog, CONTRIBUTING and the benchmark results, through MyST)
and the API reference of docs/api/, whose entries autodoc takes from the
docstrings; docs/index.md is the front page. Build it from the repository
root:

    sphinx-build -W -c docs . docs/_build/html

and open docs/_build/html/index.html (or `bazel run //testing:build_docs`).
`//testing:docs_test` builds it the same way (warnings are errors) and checks
that every name of `haiku_bridge.__all__` has an entry.
"""

import os
import re
import sys

# Document the checkout this file is in, not whatever haiku_bridge is installed
# (under Bazel, testing/build_docs.py builds a copy of the pages: there the
# package comes from the runfiles).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import haiku_bridge

project = "haiku_bridge"
author = "haiku_bridge authors"
copyright = "haiku_bridge authors"  # pylint: disable=redefined-builtin
version = release = haiku_bridge.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# The source directory is the repository root, so that the Markdown's links
# between README.md, docs/ and the benchmark results resolve as they do in the
# repository; these are the site's pages.
root_doc = "docs/index"
source_suffix = {".md": "markdown"}
include_patterns = [
    "README.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "docs/**.md",
    "testing/benchmarks/results/*.md",
]
exclude_patterns = ["bazel-*", "docs/_build", ".*"]

# Docstrings write code as `x` (Markdown's habit): show it as code, not italics.
default_role = "code"

# Google-style docstrings only; `Attributes:` as fields of the class entry
# (dataclass fields would otherwise be described twice).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
# Signatures stay one line; the types go beside each argument's description.
autodoc_typehints = "description"
# Types go beside the arguments a docstring describes: a dataclass whose `Attributes:` name its
# fields does not list them a second time, untyped, as constructor parameters.
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
# `hkb.call_pure`, not `haiku_bridge._src.call_pure.call_pure`.
add_module_names = False

# Headings get anchors, so that links such as `naming.md#layer-scan` resolve.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = f"haiku_bridge {release}"

# The generated benchmark tables (testing/benchmarks/results/pipeline.md) start
# at a level-2 heading; heading levels are all this silences.
suppress_warnings = ["myst.header"]

# Docstrings are written in the Markdown habit of the README: `x` is code, and
# a plural is `NamedSharding`s. reStructuredText ends code only before a space
# or punctuation, so an escaped space (rendered as nothing) goes between.
_CODE_THEN_LETTER = re.compile(r"(`[^`\s](?:[^`]*[^`\s])?`)(?=\w)")


def _plurals_of_code(app, what, name, obj, options, lines):
  """autodoc-process-docstring: "`x`s" to "`x`\\ s", outside examples."""
  del app, what, name, obj, options  # Unused.
  in_example = False
  for i, line in enumerate(lines):
    stripped = line.strip()
    if stripped.startswith(">>>"):
      in_example = True
    elif not stripped:
      in_example = False
    if not in_example:
      lines[i] = _CODE_THEN_LETTER.sub(r"\1\\ ", line)


def _front_page(app, exception):
  """build-finished: index.html at the top leads to docs/index.html."""
  if exception is None and app.builder.format == "html":
    with open(os.path.join(app.outdir, "index.html"), "w") as f:
      f.write('<!DOCTYPE html>\n<meta http-equiv="refresh" '
              'content="0; url=docs/index.html">\n'
              '<a href="docs/index.html">haiku_bridge</a>\n')


def setup(app):
  app.connect("autodoc-process-docstring", _plurals_of_code)
  app.connect("build-finished", _front_page)
