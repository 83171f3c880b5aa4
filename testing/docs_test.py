"""The documentation site builds with warnings as errors, and documents every public name.

It builds docs/conf.py's site (testing/build_docs.py, as `sphinx-build -W`): the README, the guides
of docs/ and the changelog through MyST, and the API reference of docs/api/ through autodoc and
napoleon. A broken link between the Markdown pages, a docstring that is not valid
reStructuredText, or an autodoc entry whose object is gone fails it; so does a name of
`haiku_bridge.__all__` that no page documents (as Haiku's docs build checks), or a class entry
that lists a field twice (its `Attributes:` as Variables, and again as constructor Parameters).
The built HTML is read as a reader sees it: every page takes the stylesheet that wraps long code
lines (docs/_static/haiku_bridge.css) instead of cutting them off at the right, the types of
parameters and fields read as written (`RematMode`, not the `~typing.Literal`s it stands for, and
no `haiku_bridge._src.` path), no entry has a "Type:" field (a property's type is its annotation,
shown beside its name; napoleon would read a docstring's opening "words: text" as one), and no two
sidebar entries share a title.

The docstrings' examples are not run here: haiku_bridge/doctest_test.py runs every `>>>` example
of every public name and method (the docstrings the API pages show) and of every module, and
testing/readme_test.py every Python snippet of the Markdown pages. Running them again under
`sphinx.ext.doctest` would repeat that work.
"""

import glob
import html
import os
import re
import tempfile
import typing

from absl.testing import absltest
from docutils import nodes
from sphinx import addnodes

import haiku_bridge as hkb
from testing import build_docs


def undocumented(public: list[str], documented: set[str]) -> list[str]:
  """The public names that have no `haiku_bridge.<name>` entry among `documented`."""
  return [name for name in public if f"haiku_bridge.{name}" not in documented]


def class_fields(doctree: nodes.Node) -> dict[str, dict[str, list[str]]]:
  """`{class: {"Variables": [name, ...], "Parameters": [...]}}` of each class entry's own fields."""
  found: dict[str, dict[str, list[str]]] = {}
  for desc in doctree.findall(addnodes.desc):
    if desc["objtype"] != "class":
      continue
    name = desc.next_node(addnodes.desc_signature)["fullname"]
    fields = found.setdefault(name, {})
    for field in desc.next_node(addnodes.desc_content).findall(nodes.field):
      owner = field.parent
      while not isinstance(owner, addnodes.desc):  # A method's fields are the method's.
        owner = owner.parent
      if owner is desc:
        fields.setdefault(field[0].astext(), []).extend(
          strong.astext() for strong in field[1].findall(nodes.strong)
        )
  return found


def listed_twice(fields: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
  """The classes whose entry lists a name both as a Variable and as a Parameter."""
  twice = {
    name: sorted(set(f.get("Variables", ())) & set(f.get("Parameters", ())))
    for name, f in fields.items()
  }
  return {name: names for name, names in twice.items() if names}


def text_of(page: str) -> str:
  """What a reader of the HTML `page` sees: its text, without tags, whitespace collapsed."""
  return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def sidebar_titles(page: str) -> list[str]:
  """The titles of the sidebar's top-level entries (the toctrees' pages) on the HTML `page`."""
  sidebar = page[page.index('<div class="sphinxsidebar"') :]
  return [
    text_of(title)
    for title in re.findall(r'<li class="toctree-l1[^"]*"><a [^>]*>(.*?)</a>', sidebar, re.DOTALL)
  ]


def type_fields(page: str) -> list[str]:
  """The entries of the HTML `page` (their ids) whose description has a "Type:" field."""
  found, entry = [], None
  for match in re.finditer(
    r'<dt class="sig sig-object py" id="([^"]+)"|'
    r'<dt class="field-\w+">Type<span class="colon">',
    page,
  ):
    if match[1]:
      entry = match[1]
    else:
      found.append(entry)
  return found


def repeated(titles: list[str]) -> list[str]:
  return sorted({title for title in titles if titles.count(title) > 1})


class DocsTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    cls.app, cls.warnings = build_docs.build(cls.out)

  def test_builds_without_warnings(self):
    self.assertEqual(self.warnings, [], "\n".join(self.warnings))
    self.assertEqual(self.app.statuscode, 0)
    for page in (
      "index.html",
      "docs/index.html",
      "docs/api/core.html",
      "README.html",
      "docs/errors.html",
      "CHANGELOG.html",
    ):
      self.assertTrue(os.path.exists(os.path.join(self.out, page)), page)

  def test_every_public_name_has_an_entry(self):
    documented = set(self.app.env.get_domain("py").objects)
    self.assertEqual(undocumented(list(hkb.__all__), documented), [])

  def test_each_field_is_listed_once(self):
    fields = {}
    for page in self.app.env.found_docs:
      if page.startswith("docs/api/"):
        fields.update(class_fields(self.app.env.get_doctree(page)))
    # Guards the walk: the dataclasses of the API, their fields as Variables.
    self.assertEqual(
      fields["Pipeline"]["Variables"], ["axis", "microbatches", "schedule", "repeats"]
    )
    self.assertIn("params", fields["ShardingReport"]["Variables"])
    self.assertIn("rules", fields["ShardingRules"]["Parameters"])
    self.assertEqual(listed_twice(fields), {})

  def test_what_explain_shardings_returns_is_public(self):
    self.assertIs(typing.get_type_hints(hkb.explain_shardings)["return"], hkb.ShardingReport)
    self.assertIn("haiku_bridge.ShardingReport", self.app.env.get_domain("py").objects)

  def test_every_page_takes_the_stylesheet_that_wraps_code(self):
    pages = glob.glob(os.path.join(self.out, "**", "*.html"), recursive=True)
    self.assertGreater(len(pages), 20)
    for path in pages:
      if os.path.basename(path) == "index.html" and os.path.dirname(path) == self.out:
        continue  # The redirect to docs/index.html.
      with open(path) as f:
        linked = re.search(r'<link [^>]*href="[./]*_static/haiku_bridge.css', f.read())
      self.assertIsNotNone(linked, f"{path} does not link _static/haiku_bridge.css")
    with open(os.path.join(self.out, "_static", "haiku_bridge.css")) as f:
      css = f.read()
    for selector in ("div.highlight pre", "span.pre"):  # Code blocks, inline code.
      rule = re.search(re.escape(selector) + r"[^{]*\{([^}]*)\}", css)
      self.assertIsNotNone(rule, selector)
      self.assertIn("white-space: pre-wrap", rule[1], selector)

  def test_types_read_as_written(self):
    pages = {}
    for path in glob.glob(os.path.join(self.out, "docs", "api", "*.html")):
      with open(path) as f:
        pages[os.path.basename(path)] = text = text_of(f.read())
      self.assertEqual(
        re.findall(r".{0,40}(?:typing\.|haiku_bridge\._src\.).{0,40}", text), [], path
      )
    self.assertIn("remat (RematMode)", pages["layer_scan.html"])
    self.assertIn("remat (RematMode)", pages["time_scan.html"])
    self.assertIn("schedule (PipelineSchedule)", pages["pipelines_and_sharding.html"])
    self.assertIn("rules (ShardingRules)", pages["pipelines_and_sharding.html"])

  def test_no_entry_has_a_type_field(self):
    pages = {}
    for path in glob.glob(os.path.join(self.out, "docs", "api", "*.html")):
      with open(path) as f:
        pages[os.path.basename(path)] = f.read()
      self.assertEqual(type_fields(pages[os.path.basename(path)]), [], path)
    # The properties whose opening words napoleon took for a type read as their docstrings do.
    text = text_of(pages["layer_scan.html"])
    self.assertIn(
      "least_budget: int¶ The least memory_budget any candidate fits: its predicted "
      "temporaries, bytes.",
      text,
    )
    self.assertIn(
      "unused_rules: list[Rule]¶ Rules that matched no parameter: often a typo",
      text_of(pages["pipelines_and_sharding.html"]),
    )

  def test_type_fields_finds_a_type_field(self):
    page = (
      '<dl class="py class"><dt class="sig sig-object py" id="hkb.A">A</dt><dd>'
      '<dl class="py property"><dt class="sig sig-object py" id="hkb.A.p">p</dt><dd><p>x</p>'
      '<dl class="field-list simple"><dt class="field-odd">Type<span class="colon">:</span>'
      '</dt><dd class="field-odd"><p>Words</p></dd></dl></dd></dl>'
      '<dt class="sig sig-object py" id="hkb.A.q">q</dt><dd><dl class="field-list simple">'
      '<dt class="field-odd">Types<span class="colon">:</span></dt></dl></dd></dd></dl>'
    )
    self.assertEqual(type_fields(page), ["hkb.A.p"])

  def test_sidebar_titles_are_distinct(self):
    with open(os.path.join(self.out, "docs", "api", "core.html")) as f:
      titles = sidebar_titles(f.read())
    self.assertContainsSubset(["Core: call_pure", "Errors", "Changelog"], titles)
    self.assertEqual(repeated(titles), [])

  def test_sidebar_titles_finds_a_repeated_title(self):
    page = (
      '<div class="sphinxsidebar"><ul><li class="toctree-l1"><a href="a.html">Time <code>'
      'scan</code></a></li><li class="toctree-l1 current"><a class="x" href="b.html">Time '
      'scan</a><ul><li class="toctree-l2"><a href="#c">Time scan</a></li></ul></li></ul>'
    )
    self.assertEqual(sidebar_titles(page), ["Time scan", "Time scan"])
    self.assertEqual(repeated(sidebar_titles(page) + ["Other"]), ["Time scan"])

  def test_listed_twice_finds_a_repeated_field(self):
    fields = {"A": {"Variables": ["x", "y"], "Parameters": ["y", "z"]}, "B": {"Parameters": ["x"]}}
    self.assertEqual(listed_twice(fields), {"A": ["y"]})

  def test_undocumented_finds_a_missing_entry(self):
    documented = {"haiku_bridge.call_pure", "haiku_bridge._src.scan.layer_scan"}
    self.assertEqual(undocumented(["call_pure", "layer_scan"], documented), ["layer_scan"])


if __name__ == "__main__":
  absltest.main()
