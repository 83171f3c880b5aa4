"""Builds the documentation site (docs/conf.py) as HTML, warnings as errors.

    bazel run //testing:build_docs                 # into docs/_build/html of the checkout
    bazel run //testing:build_docs -- --out=DIR
    sphinx-build -W -c docs . docs/_build/html     # the same, without Bazel (pip install ".[docs]")

Then open docs/_build/html/index.html. //testing:docs_test builds it the same way.
"""

import argparse
import io
import os
import shutil
import sys
import tempfile

from sphinx import application

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the site reads (docs/conf.py's include_patterns, and the files the pages link).
SITE = (
  "README.md",
  "CHANGELOG.md",
  "CONTRIBUTING.md",
  "RELEASING.md",
  "docs",
  os.path.join("testing", "benchmarks", "results"),
)


def build(
  out_dir: str, *, status: io.TextIOBase | None = None
) -> tuple[application.Sphinx, list[str]]:
  """Builds the site into `out_dir`: the application and the warnings it gave."""
  warnings = io.StringIO()
  with tempfile.TemporaryDirectory() as copy:
    # Sphinx follows symlinks when it resolves a link between pages, which leads out of Bazel's
    # runfiles (a tree of symlinks into the checkout): there, build from a copy of the files.
    source = ROOT
    if os.path.islink(os.path.join(ROOT, "README.md")):
      source = copy
      for name in SITE:
        path, target = os.path.join(ROOT, name), os.path.join(copy, name)
        if os.path.isdir(path):
          shutil.copytree(path, target)
        else:
          shutil.copy(path, target)
    app = application.Sphinx(
      srcdir=source,
      confdir=os.path.join(source, "docs"),
      outdir=out_dir,
      doctreedir=os.path.join(out_dir, ".doctrees"),
      buildername="html",
      status=status,
      warning=warnings,
      freshenv=True,
      warningiserror=True,
    )
    app.build()
  return app, [line for line in warnings.getvalue().splitlines() if line.strip()]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  # Under `bazel run`, the checkout is BUILD_WORKSPACE_DIRECTORY, not the runfiles.
  checkout = os.environ.get("BUILD_WORKSPACE_DIRECTORY", ROOT)
  parser.add_argument(
    "--out",
    default=os.path.join(checkout, "docs", "_build", "html"),
    help="where the HTML goes (default: %(default)s)",
  )
  args = parser.parse_args()
  app, warnings = build(args.out, status=sys.stdout)
  print("\n".join(warnings), file=sys.stderr)
  if app.statuscode:
    return app.statuscode
  print(f"Open {os.path.join(args.out, 'index.html')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
