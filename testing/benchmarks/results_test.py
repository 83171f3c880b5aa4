"""Every script, module, Bazel target and path the benchmark results name is in the repository.

A figure in testing/benchmarks/results/ names the command that reproduces it (STYLE.md: results
are reproducible, lab notes are not results). This test reads RESULTS.md and the other pages there
(results/*.md, accelerator_tpu_v5e/summary.md) and checks each name they give:

- a script, `*.py` or `*.sh`: a path from the repository's root or from the page, or a name a
  repository file ends with (`lib/trace_rows.py`, `plan_test.py`). A profile's location
  (`call_pure.py:33(call_pure)`, tables.md) is not a script;
- a module run as `python -m a.b.c` whose package is one of the repository's: `a/b/c.py` or
  `a/b/c/__init__.py` (`python -m pytest` is not ours);
- a Bazel label `//pkg:name` (or `//pkg`, `name` its last part): `pkg/BUILD` declares
  `name = "name"`;
- a path that starts at one of the repository's top-level folders (`testing/transformer.py`,
  `docs/sharding.md`), and a Markdown link's target, from the page's folder.

The one exception is a figure whose only source is a scratch script that was never committed:
RESULTS.md keeps it in its appendix ("## Appendix ..."), in a paragraph, list item or table row
that says "scratch script, not in the repository" (or "scratch scripts"); the other pages keep such
notes where they are, marked the same way. A name outside such an entry must exist.

Under Bazel the pages are runfiles links to the checkout's files: the repository they name is read
beside them, in the checkout (as testing/accelerator_check_test.py reads its script's).
"""

import dataclasses
import glob
import os
import re
from typing import Iterator

from absl.testing import absltest

# The pages, read in the checkout (their real path), and the repository's root above them.
RESULTS_DIR = os.path.dirname(
  os.path.realpath(os.path.join(os.path.dirname(__file__), "results", "RESULTS.md"))
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(RESULTS_DIR)))

SCRATCH = re.compile(r"scratch scripts?,\s+not\s+in\s+the\s+repository", re.I)
APPENDIX = re.compile(r"^## Appendix\b", re.M)

_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
_MODULE = re.compile(r"\bpython(?:3(?:\.\d+)?)?(?:\s+-[A-Za-z]\S*)*\s+-m\s+([A-Za-z_][\w.]*\w)")
_LABEL = re.compile(r"(?<![\w:/@])//([\w/.+-]*)(?::([^\s`'\")\],;]+))?")
_SCRIPT = re.compile(r"(?<![\w/.<>*-])((?:/|\.\.?/)?(?:[\w.-]+/)*[\w.-]*\w\.(?:py|sh))(?![\w:])")
_PATH = re.compile(r"(?<![\w/.<>*-])(\.?[\w-]+(?:/[\w.-]+)+/?)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Folders no repository file lives under: Bazel's output links, caches, builds, environments.
_NOT_REPOSITORY = re.compile(
  r"^(\.(?!ci$).*|bazel-.*|__pycache__|.*\.egg-info|venv|_build|build|dist)$"
)


@dataclasses.dataclass(frozen=True)
class Name:
  """One name a page gives: its kind, as written, and the line it is on."""

  kind: str  # "script", "module", "target", "path" or "link".
  text: str
  line: int


def repository_files(root: str) -> set[str]:
  """The repository's files, as paths from `root` ("testing/setup.sh")."""
  found = set()
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if not _NOT_REPOSITORY.match(d)]
    found.update(os.path.relpath(os.path.join(folder, f), root) for f in files)
  return found


def blocks(text: str) -> Iterator[tuple[int, str]]:
  """`(first line, text)` of each paragraph, list item, table row and heading of Markdown `text`.

  A fenced code block is one block (with the lines around it up to a blank line).
  """
  start, lines, fenced = 1, [], False
  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith("```"):
      fenced = not fenced
    opens = not fenced and re.match(r" {0,3}([-*+] |\d+\. |\||#)", line)
    if lines and (opens or (not line.strip() and not fenced)):
      yield start, "\n".join(lines)
      lines = []
    if line.strip() or fenced:
      if not lines:
        start = number
      lines.append(line)
  if lines:
    yield start, "\n".join(lines)


def _blank(pattern: re.Pattern[str], text: str, keep: str = "") -> str:
  """`text` with each match of `pattern` blanked out (`keep` left at its start): same positions."""
  return pattern.sub(lambda m: keep + " " * (len(m[0]) - len(keep)), text)


def names(text: str, top_level: set[str]) -> Iterator[Name]:
  """The names of a Markdown block's `text`, each with its line from the block's first (0).

  A command may break across lines (`python3 -m` at one's end, the module at the next's start).
  `top_level`: the entries of the repository's root.
  """
  text = _blank(_URL, text)
  found: list[tuple[int, str, str]] = []
  for m in _MODULE.finditer(text):
    if m[1].split(".")[0] in top_level:
      found.append((m.start(1), "module", m[1]))
  for m in _LABEL.finditer(text):
    if not any(c in m[0] for c in "<*") and not m[1].endswith("..."):
      found.append((m.start(), "target", m[0].rstrip(".:")))
  for m in _LINK.finditer(text):
    if not m[1].startswith(("#", "mailto:")):
      found.append((m.start(1), "link", m[1].split("#")[0]))
  text = _blank(_LINK, text, keep="]")
  for m in _SCRIPT.finditer(text):
    found.append((m.start(1), "script", m[1]))
  for m in _PATH.finditer(text):
    if m[1].split("/")[0] in top_level and not m[1].endswith((".py", ".sh")):
      found.append((m.start(1), "path", m[1]))
  for start, kind, name in sorted(found):
    yield Name(kind, name, text.count("\n", 0, start))


class Repository:
  """What the repository at `root` holds, to tell whether a name a page gives is there."""

  def __init__(self, root: str):
    self.root = root
    self.files = repository_files(root)
    self.basenames = {os.path.basename(f) for f in self.files}
    self.folders = {os.path.dirname(f) for f in self.files}
    for folder in list(self.folders):
      while folder:
        folder = os.path.dirname(folder)
        self.folders.add(folder)
    self.top_level = {f.split(os.sep)[0] for f in self.files} - {""}

  def _path(self, path: str, page_dir: str) -> bool:
    """Whether `path` (from the root, or from `page_dir`, a folder from the root) is a file or folder."""
    if os.path.isabs(path):
      return False
    for base in ("", page_dir):
      found = os.path.normpath(os.path.join(base, path))
      if found in self.files or found in self.folders:
        return True
    return False

  def has(self, name: Name, page_dir: str) -> bool:
    if name.kind == "module":
      path = name.text.replace(".", "/")
      return f"{path}.py" in self.files or f"{path}/__init__.py" in self.files
    if name.kind == "target":
      package, _, target = name.text[2:].partition(":")
      build = os.path.join(package, "BUILD")
      if build not in self.files:
        return False
      with open(os.path.join(self.root, build)) as f:
        return f'name = "{target or os.path.basename(package)}"' in f.read()
    if name.kind == "script":
      if "/" not in name.text:
        return name.text in self.basenames
      return self._path(name.text, page_dir) or (
        not os.path.isabs(name.text)
        and any(f.endswith("/" + name.text.lstrip("./")) for f in self.files)
      )
    path = name.text.rstrip("/")  # A path or a link; `a/b.f` may name a module's function.
    return self._path(path, page_dir) or (
      name.kind == "path"
      and "." in os.path.basename(path)
      and self._path(path.rsplit(".", 1)[0] + ".py", page_dir)
    )

  def missing(self, page: str, text: str) -> list[str]:
    """`"page:line: kind name"` of each name of `text` (the page `page`, from the root) not here.

    Scratch entries are left out: in RESULTS.md from its appendix on, in the other pages anywhere.
    """
    page_dir = os.path.dirname(page)
    appendix = APPENDIX.search(text)
    if os.path.basename(page) != "RESULTS.md":
      scratch_from = 1
    elif appendix:
      scratch_from = text.count("\n", 0, appendix.start()) + 1
    else:
      scratch_from = None  # No appendix: no scratch entry anywhere.
    found = []
    for start, block in blocks(text):
      if scratch_from is not None and start >= scratch_from and SCRATCH.search(block):
        continue
      for name in names(block, self.top_level):
        if not self.has(name, page_dir):
          found.append(f"{page}:{start + name.line}: {name.kind} {name.text}")
    return found


def pages() -> list[str]:
  """The results pages, as paths from the root."""
  found = glob.glob(os.path.join(RESULTS_DIR, "**", "*.md"), recursive=True)
  return sorted(os.path.relpath(p, ROOT) for p in found)


class ResultsPagesTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.repository = Repository(ROOT)

  def test_every_name_a_results_page_gives_is_in_the_repository(self):
    checked = pages()
    self.assertIn("testing/benchmarks/results/RESULTS.md", checked)
    self.assertIn("testing/benchmarks/results/accelerator_tpu_v5e/summary.md", checked)
    missing = []
    for page in checked:
      with open(os.path.join(ROOT, page)) as f:
        missing += self.repository.missing(page, f.read())
    self.assertEqual(missing, [], "\n" + "\n".join(missing))

  def test_results_opens_with_a_contents_list_of_its_sections(self):
    with open(os.path.join(RESULTS_DIR, "RESULTS.md")) as f:
      text = f.read()
    sections = re.findall(r"^## (.+)$", text, re.M)
    listed = re.findall(r"^- \[(.+?)\]\(#[\w-]+\)$", text[: text.index("\n## ")], re.M)
    self.assertEqual(listed, [re.sub(r"`", "", s) for s in sections])
    self.assertTrue(sections[-1].startswith("Appendix"), sections[-1])


class CheckerTest(absltest.TestCase):
  """The checker on pages written here, against this repository: each kind of name, both ways."""

  PAGE = "testing/benchmarks/results/RESULTS.md"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.repository = Repository(ROOT)

  def missing(self, text: str, page: str = PAGE) -> list[str]:
    return [m.split(": ", 1)[1] for m in self.repository.missing(page, text)]

  def test_each_kind_of_name_that_exists(self):
    self.assertEqual(
      self.missing(
        "`PYTHONPATH=. python3 testing/benchmarks/remat_benchmark.py`, then\n"
        "`python -m testing.benchmarks.accelerator_figures --small` and `bazel run\n"
        "//testing/benchmarks:cache_benchmark`, `bash testing/accelerator_check.sh OUT`;\n"
        "`lib/trace_rows.py`, `plan_test.py`, `testing/transformer.py`, `docs/sharding.md`,\n"
        "[the tables](tables.md), `python -m pytest`, `bazel test //...`, `//haiku_bridge`,\n"
        "`testing/backend_tolerance.numerical()`.\n"
      ),
      [],
    )

  def test_each_kind_of_name_that_does_not(self):
    self.assertCountEqual(
      self.missing(
        "`prof2.py MODEL`, `.whl-tpu/run14.sh`, `/tmp/probe/p19.py`, `lib/nowhere.py`,\n"
        "`python -m testing.benchmarks.nowhere`, `//testing/benchmarks:nowhere`, `python3 -m\n"
        "testing.nowhere --flag`,\n"
        "`//testing/nowhere:x`, `testing/nowhere.md`, [gone](gone.md#x).\n"
      ),
      [
        "script prof2.py",
        "script .whl-tpu/run14.sh",
        "script /tmp/probe/p19.py",
        "script lib/nowhere.py",
        "module testing.benchmarks.nowhere",
        "module testing.nowhere",
        "target //testing/benchmarks:nowhere",
        "target //testing/nowhere:x",
        "path testing/nowhere.md",
        "link gone.md",
      ],
    )

  def test_a_profile_location_is_not_a_script(self):
    self.assertEqual(self.missing("| `api.py:2317(eval_shape)` | 2 | 24.51 |\n"), [])

  def test_a_scratch_entry_counts_in_the_appendix_of_results_only(self):
    entry = (
      "- Timed in parts (`prof2.py`: a scratch script, not in the repository).\n"
      "- Timed again (`opts.py`).\n"
    )
    appendix = "## Results\n\nText.\n\n## Appendix: lab notes\n\n" + entry
    self.assertEqual(self.missing(appendix), ["script opts.py"])
    self.assertEqual(self.missing("## Results\n\n" + entry), ["script prof2.py", "script opts.py"])
    self.assertEqual(
      self.missing(entry, "testing/benchmarks/results/remat_auto.md"), ["script opts.py"]
    )

  def test_a_block_ends_at_a_blank_line_a_list_item_or_a_table_row(self):
    self.assertEqual(
      [start for start, _ in blocks("a\nb\n\n- c\n  d\n- e\n| f |\n| g |\n## h\n")],
      [1, 4, 6, 7, 8, 9],
    )


if __name__ == "__main__":
  absltest.main()
