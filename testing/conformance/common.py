"""What the conformance tests share: comparing Haiku dicts, listing Haiku's cases."""

import ast
import os

import chex
import haiku as hk


def assert_same_tree(test, actual, expected, **tolerances):
  """Same bundles and names (with readable diffs), then equal or close values."""
  test.assertEqual(sorted(actual), sorted(expected))
  for bundle in expected:
    test.assertEqual(sorted(actual[bundle]), sorted(expected[bundle]), msg=bundle)
  if tolerances:
    chex.assert_trees_all_close(dict(actual), dict(expected), **tolerances)
  else:
    chex.assert_trees_all_equal(dict(actual), dict(expected))


def haiku_test_cases(filename: str) -> set[str]:
  """The `test_*` functions of one of the installed dm-haiku's own test files."""
  path = os.path.join(os.path.dirname(hk.__file__), "_src", filename)
  with open(path) as f:
    tree = ast.parse(f.read())
  return {
    node.name
    for node in ast.walk(tree)
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
  }
