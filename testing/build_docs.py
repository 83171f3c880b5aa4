"""Builds the documentation site (docs/conf.py) as HTML, warnings as errors.

    bazel run //testing:build_docs                 # into docs/_build/html of the checkout
    bazel run //testing:build_docs -- --out=DIR
    sphinx-build -W -c docs . docs/_build/html     # the same, without Bazel (pip install ".[docs]")

Then open docs/_build/html/index.html. //testing:docs_test builds it the same way.
"""

import argparse
import io
import os
import sys

from sphinx import application

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(out_dir: str, *, status: io.TextIOBase | None = None
          ) -> tuple[application.Sphinx, list[str]]:
  """Builds the site into `out_dir`: the application and the warnings it gave."""
  warnings = io.StringIO()
  app = application.Sphinx(
      srcdir=ROOT, confdir=os.path.join(ROOT, "docs"), outdir=out_dir,
      doctreedir=os.path.join(out_dir, ".doctrees"), buildername="html",
      status=status, warning=warnings, freshenv=True, warningiserror=True)
  app.build()
  return app, [line for line in warnings.getvalue().splitlines() if line.strip()]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  # Under `bazel run`, the checkout is BUILD_WORKSPACE_DIRECTORY, not the runfiles.
  checkout = os.environ.get("BUILD_WORKSPACE_DIRECTORY", ROOT)
  parser.add_argument("--out", default=os.path.join(checkout, "docs", "_build", "html"),
                      help="where the HTML goes (default: %(default)s)")
  args = parser.parse_args()
  app, warnings = build(args.out, status=sys.stdout)
  print("\n".join(warnings), file=sys.stderr)
  if app.statuscode:
    return app.statuscode
  print(f"Open {os.path.join(args.out, 'index.html')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
