"""The public signatures that the prose of the README and the guides names agree with the code.

readme_test.py runs their snippets; this checks the calls written in their text, in inline code
such as `hkb.layer_scan(layer, carry, xs=None, *, num_layers=None, ...)`:

- every keyword argument written in a call of a public name exists in that name's signature
  (for `repeat_layer`, whose `**options` are `layer_scan`'s, in either);
- a listed signature, one written with parameter names and defaults only and with `*`, `*args`
  or `**kwargs` among them, leaves out none of the keyword arguments of the real one (parameters
  with a default, or keyword-only), and has `*args` and `**kwargs` exactly where the real one has
  them.

Other calls are usage (`hkb.from_flax(module)`, `call_pure(hk.transform(f), *args)`): only the
first check applies to them.
Haiku's own names (`hk.layer_stack(...)`) are not checked.
"""

import glob
import inspect
import os
import re
from typing import Any, Callable, NamedTuple

from absl.testing import absltest

import haiku_bridge as hkb

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DOCS = ["README.md"] + sorted(
  os.path.relpath(path, _ROOT) for path in glob.glob(os.path.join(_ROOT, "docs", "*.md"))
)
# Public functions whose `**kwargs` are another public function's keyword arguments.
_FORWARDS = {"repeat_layer": "layer_scan"}


class Call(NamedTuple):
  """A call of a public name, as the README writes it."""

  name: str  # As after `hkb.`: `layer_scan`, `ShardingRules.from_foreign`.
  args: list[str]  # Each argument as written.
  text: str

  @property
  def keywords(self) -> list[str]:
    return [a.split("=", 1)[0].strip() for a in self.args if re.match(r"^\w+\s*=", a)]

  @property
  def is_listing(self) -> bool:
    """Names and defaults only (no expression), with `*`, `*args` or `**kwargs` among them."""
    return all(re.match(r"^(\*{0,2}\w+|\*|\w+\s*=.*)$", a) for a in self.args) and any(
      a.startswith("*") for a in self.args
    )


def prose(markdown: str) -> str:
  """`markdown` without its fenced code blocks (those run as tests)."""
  return re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)


def split_args(text: str) -> list[str]:
  """`text` split at the commas outside brackets and strings."""
  args, depth, quote, start = [], 0, None, 0
  for i, c in enumerate(text):
    if quote:
      quote = None if c == quote else quote
    elif c in "\"'":
      quote = c
    elif c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      args.append(text[start:i])
      start = i + 1
  args.append(text[start:])
  return [" ".join(a.split()) for a in args if a.strip()]


def public_calls(markdown: str) -> list[Call]:
  """Each inline-code call of a name of `hkb.__all__` (with `hkb.` or without)."""
  calls = []
  for span in re.findall(r"`([^`]+)`", prose(markdown)):
    match = re.match(r"^(?:hkb\.)?(\w+(?:\.\w+)*)\((.*)\)(?:\s*->.*)?$", span.strip(), re.DOTALL)
    if match and match[1].split(".")[0] in hkb.__all__ and match[1].split(".")[0] != "hk":
      calls.append(Call(match[1], split_args(match[2]), " ".join(span.split())))
  return calls


def resolve(name: str) -> Callable[..., Any]:
  obj = hkb
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def keyword_params(fn: Callable[..., Any]) -> set[str]:
  """The parameters a caller may pass by keyword and may leave out, or must name."""
  return {
    p.name
    for p in inspect.signature(fn).parameters.values()
    if p.kind == p.KEYWORD_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)
  }


def var_kinds(fn: Callable[..., Any]) -> set[str]:
  """`"*args"` and `"**kwargs"`, where `fn` has them (under any name)."""
  kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
  return ({"*args"} if inspect.Parameter.VAR_POSITIONAL in kinds else set()) | (
    {"**kwargs"} if inspect.Parameter.VAR_KEYWORD in kinds else set()
  )


def listed_var_kinds(call: Call) -> set[str]:
  return ({"*args"} if any(re.match(r"^\*\w", a) for a in call.args) else set()) | (
    {"**kwargs"} if any(a.startswith("**") for a in call.args) else set()
  )


def unknown_keywords(call: Call) -> list[str]:
  """The keywords `call` writes that its function does not take."""
  accepted = {p for p in inspect.signature(resolve(call.name)).parameters}
  if call.name in _FORWARDS:
    accepted |= keyword_params(resolve(_FORWARDS[call.name]))
  return [k for k in call.keywords if k not in accepted]


def left_out(call: Call) -> list[str]:
  """What a listed signature leaves out of the real one's keywords and star arguments."""
  fn = resolve(call.name)
  missing = sorted(keyword_params(fn) - set(call.keywords))
  return missing + sorted(var_kinds(fn) ^ listed_var_kinds(call))


class ReadmeSignaturesTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.calls = []
    for doc in _DOCS:
      with open(os.path.join(_ROOT, doc)) as f:
        self.calls += public_calls(f.read())

  def test_calls_are_found(self):
    # Guards the parsing, and that the guides are read: the README and docs/sharding.md name these
    # signatures today.
    self.assertIn(os.path.join("docs", "sharding.md"), _DOCS)
    names = {call.name for call in self.calls}
    self.assertContainsSubset(
      {
        "call_pure",
        "layer_scan",
        "repeat_layer",
        "custom_vjp",
        "from_flax",
        "ShardingRules.from_foreign",
      },
      names,
    )
    listings = {call.name for call in self.calls if call.is_listing}
    self.assertContainsSubset({"call_pure", "layer_scan", "repeat_layer"}, listings)

  def test_every_keyword_exists(self):
    unknown = {call.text: unknown_keywords(call) for call in self.calls}
    self.assertEqual({text: kws for text, kws in unknown.items() if kws}, {})

  def test_listed_signatures_are_complete(self):
    missing = {call.text: left_out(call) for call in self.calls if call.is_listing}
    self.assertEqual({text: m for text, m in missing.items() if m}, {})

  def test_checks_catch_a_wrong_signature(self):
    [short, wrong, usage, star_usage] = public_calls(
      "`hkb.layer_scan(layer, carry, xs=None, *, num_layers=None)` and "
      "`hkb.repeat_layer(block, x, 4, remat=True, remat_sheme=1)` and "
      "`hkb.from_flax(module, method='attend')` and `call_pure(hk.transform(f), *args)`, "
      "not `hk.layer_stack(4)`.\n```python\nhkb.call_pure(fn, typo=1)\n```\n"
    )
    self.assertTrue(short.is_listing)
    self.assertIn("pipeline", left_out(short))
    self.assertEqual(unknown_keywords(wrong), ["remat_sheme"])
    self.assertFalse(usage.is_listing)
    self.assertEqual(unknown_keywords(usage), [])
    self.assertFalse(star_usage.is_listing)
    self.assertEqual(split_args("f, (a, b), x='a,b', **kw"), ["f", "(a, b)", "x='a,b'", "**kw"])


if __name__ == "__main__":
  absltest.main()
