"""The documentation site builds with warnings as errors, and documents every public name.

It builds docs/conf.py's site (testing/build_docs.py, as `sphinx-build -W`): the README, the guides
of docs/ and the changelog through MyST, and the API reference of docs/api/ through autodoc and
napoleon. A broken link between the Markdown pages, a docstring that is not valid
reStructuredText, or an autodoc entry whose object is gone fails it; so does a name of
`haiku_bridge.__all__` that no page documents (as Haiku's docs build checks), or a class entry
that lists a field twice (its `Attributes:` as Variables, and again as constructor Parameters).

The docstrings' examples are not run here: haiku_bridge/doctest_test.py runs every `>>>` example
of every public name and method (the docstrings the API pages show) and of every module, and
testing/readme_test.py every Python snippet of the Markdown pages. Running them again under
`sphinx.ext.doctest` would repeat that work.
"""

import os
import tempfile

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
            strong.astext() for strong in field[1].findall(nodes.strong))
  return found


def listed_twice(fields: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
  """The classes whose entry lists a name both as a Variable and as a Parameter."""
  twice = {name: sorted(set(f.get("Variables", ())) & set(f.get("Parameters", ())))
           for name, f in fields.items()}
  return {name: names for name, names in twice.items() if names}


class DocsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    cls.app, cls.warnings = build_docs.build(cls.out)

  def test_builds_without_warnings(self):
    self.assertEqual(self.warnings, [], "\n".join(self.warnings))
    self.assertEqual(self.app.statuscode, 0)
    for page in ("index.html", "docs/index.html", "docs/api/core.html", "README.html",
                 "docs/errors.html", "CHANGELOG.html"):
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
    self.assertEqual(fields["Pipeline"]["Variables"],
                     ["axis", "microbatches", "schedule", "repeats"])
    self.assertIn("params", fields["ShardingReport"]["Variables"])
    self.assertIn("rules", fields["ShardingRules"]["Parameters"])
    self.assertEqual(listed_twice(fields), {})

  def test_listed_twice_finds_a_repeated_field(self):
    fields = {"A": {"Variables": ["x", "y"], "Parameters": ["y", "z"]},
              "B": {"Parameters": ["x"]}}
    self.assertEqual(listed_twice(fields), {"A": ["y"]})

  def test_undocumented_finds_a_missing_entry(self):
    documented = {"haiku_bridge.call_pure", "haiku_bridge._src.scan.layer_scan"}
    self.assertEqual(undocumented(["call_pure", "layer_scan"], documented), ["layer_scan"])


if __name__ == "__main__":
  absltest.main()
