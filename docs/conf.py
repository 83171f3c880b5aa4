"""Sphinx configuration of haiku_bridge's documentation site.

The site is the repository's Markdown as it is (the README, the guides of
docs/, the changelog, CONTRIBUTING, RELEASING and the benchmark results, through MyST)
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

from sphinx.util.typing import stringify_annotation

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
  "RELEASING.md",
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
# A text column wide enough for the docstrings' 100-column examples; what is still wider wraps
# (_static/haiku_bridge.css), never runs off the right.
html_theme_options = {"page_width": "1180px", "body_max_width": "none"}
html_static_path = ["_static"]
html_css_files = ["haiku_bridge.css"]

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


# The public type aliases, shown by name and linked to their entry wherever a parameter or a field
# is annotated with one, instead of the `Literal`s it stands for (`RematMode`, not
# `bool | Literal['nested', 'binomial'] | ~typing.Literal['auto']`). autodoc_type_aliases cannot
# do this: it applies only to annotations written as strings.
_ALIASES = {"RematMode": haiku_bridge.RematMode, "PipelineSchedule": haiku_bridge.PipelineSchedule}


def _alias_spellings(short_literals: bool) -> list[tuple[str, str]]:
  """`(how Sphinx writes an alias's type, its name)`, longest first.

  Each in the modes that autodoc (parameters) and napoleon (fields) write annotations in.
  """
  spelled = {}
  for name, alias in _ALIASES.items():
    for mode in ("smart", "fully-qualified-except-typing", "fully-qualified"):
      text = stringify_annotation(alias, mode, short_literals=short_literals)
      spelled[text] = f"~haiku_bridge.{name}"
  return sorted(spelled.items(), key=lambda item: -len(item[0]))


# napoleon writes a field's class by its full path (`haiku_bridge._src.sharding.ShardingRules`).
_PRIVATE_PATH = re.compile(r"(?<![\w.~])haiku_bridge\._src(?:\.\w+)*\.(\w+)")


def _public_path(match: re.Match[str]) -> str:
  """A class of the library by its public name where it has one, else by its own name."""
  name = match[1]
  if name in haiku_bridge.__all__:
    return f"~haiku_bridge.{name}"
  return f"~{match[0]}"


def _readable_types(app, text: str) -> str:
  """`text` with the aliases by name, and the library's classes by their public names."""
  for spelled, name in _alias_spellings(app.config.python_display_short_literal_types):
    text = text.replace(spelled, name)
  return _PRIVATE_PATH.sub(_public_path, text)


def _readable_signature_types(app, what, name, obj, options, signature, return_annotation):
  """autodoc-process-signature: the parameter types autodoc recorded, readable."""
  del what, obj, options, signature, return_annotation  # Unused.
  annotations = app.env.current_document.autodoc_annotations.get(name, {})
  for param, text in annotations.items():
    annotations[param] = _readable_types(app, text)


def _readable_field_types(app, what, name, obj, options, lines):
  """autodoc-process-docstring, after napoleon: the `:vartype:` / `:type:` fields, readable."""
  del what, name, obj, options  # Unused.
  for i, line in enumerate(lines):
    if re.match(r"\s*:(var)?type ", line):
      lines[i] = _readable_types(app, line)


def _prose_not_type(app, what, name, obj, options, lines):
  """autodoc-process-docstring, after napoleon: a property's opening words are not a type.

  Google style lets a property's or an attribute's docstring open with its type (`int: How
  many.`), and napoleon takes whatever precedes the first line's first colon for one: "Rules that
  matched no parameter: often a typo in a pattern." became a "Type: Rules that matched no
  parameter" field (sphinx-doc/sphinx#9273). Here types are annotations, which autodoc shows
  beside the name, and a docstring never opens with one: the words go back in front of the text.
  """
  del app, name, obj, options  # Unused.
  if what in ("property", "attribute", "data") and len(lines) >= 3 and lines[0]:
    if lines[-1].startswith(":type: ") and not lines[-2]:
      words = lines.pop()[len(":type: ") :]
      lines.pop()
      lines[0] = f"{words}: {lines[0]}"


def _front_page(app, exception):
  """build-finished: index.html at the top leads to docs/index.html."""
  if exception is None and app.builder.format == "html":
    with open(os.path.join(app.outdir, "index.html"), "w") as f:
      f.write(
        '<!DOCTYPE html>\n<meta http-equiv="refresh" '
        'content="0; url=docs/index.html">\n'
        '<a href="docs/index.html">haiku_bridge</a>\n'
      )


def setup(app):
  app.connect("autodoc-process-docstring", _plurals_of_code)
  app.connect("autodoc-process-docstring", _prose_not_type, priority=550)  # napoleon's is 500.
  app.connect("autodoc-process-docstring", _readable_field_types, priority=600)
  app.connect("autodoc-process-signature", _readable_signature_types)
  app.connect("build-finished", _front_page)
