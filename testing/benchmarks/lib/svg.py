"""The benchmarks' one plotting stack, SVG with no dependency: panels, axes, lines, markers, legends.

Each function returns SVG elements as strings; a plot joins them between
`open_document` and `close_document`. Every point carries a `<title>` (the
figure behind it, shown on hover), so a plot is checkable as XML.
"""

import math
from typing import NamedTuple, Sequence
from xml.sax import saxutils


def _attribute(text: str) -> str:
  """`text` escaped for a double-quoted attribute (a series' name may hold quotes)."""
  return saxutils.escape(text, {'"': "&quot;"})


def tick_step(top: float) -> float:
  """A round step (1, 2, 2.5 or 5 × a power of ten) that splits [0, top] in at most 5."""
  power = 10 ** math.floor(math.log10(top / 5))
  return next(power * k for k in (1, 2, 2.5, 5, 10) if power * k * 5 >= top)


class Panel(NamedTuple):
  """A plotting area: its box in pixels and the ranges its axes show.

  x is log2-scaled when `x_log`; y is linear from 0 to `y_top`, or, with
  `y_log`, log-scaled from `y_low` to `y_top`.
  """

  left: float
  top: float
  width: float
  height: float
  x_low: float
  x_high: float
  y_top: float
  x_log: bool = False
  pad: float = 20  # Pixels between the frame and the first and last x.
  y_low: float = 0
  y_log: bool = False

  def x(self, value: float) -> float:
    f = math.log2 if self.x_log else (lambda v: v)
    span = max(f(self.x_high) - f(self.x_low), 1e-12 if not self.x_log else 1)
    return self.left + self.pad + (self.width - 2 * self.pad) * (f(value) - f(self.x_low)) / span

  def y(self, value: float) -> float:
    if self.y_log:
      low = math.log10(self.y_low)
      return self.top + self.height * (
        1 - (math.log10(value) - low) / (math.log10(self.y_top) - low)
      )
    return self.top + self.height * (1 - value / self.y_top)

  def y_ticks(self, step: float) -> list[float]:
    """Every `step` from 0 (linear), or 1, 2 and 5 × powers of ten in range (log)."""
    if not self.y_log:
      return [step * i for i in range(round(self.y_top / step) + 1)]
    return [
      m * 10.0**k
      for k in range(math.floor(math.log10(self.y_low)), math.ceil(math.log10(self.y_top)) + 1)
      for m in (1, 2, 5)
      if self.y_low <= m * 10.0**k <= self.y_top
    ]


def open_document(width: float, height: float, title: str) -> list[str]:
  """The `<svg>` element's opening, a white background and the title."""
  return [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
    f'height="{height}" viewBox="0 0 {width} {height}" '
    'font-family="sans-serif" font-size="11">',
    f'<rect width="{width}" height="{height}" fill="white"/>',
    f'<text x="{width / 2:.0f}" y="18" text-anchor="middle" '
    f'font-size="13">{saxutils.escape(title)}</text>',
  ]


def close_document(parts: list[str]) -> str:
  return "\n".join(parts + ["</svg>"]) + "\n"


def frame(
  p: Panel,
  title: str,
  y_step: float,
  x_ticks: Sequence[tuple[float, str]],
  x_label: str,
  y_label: str,
  y_format: str = ".2f",
) -> list[str]:
  """The panel's box, its title, the y grid (`Panel.y_ticks`), the x ticks and the axis labels."""
  parts = [
    f'<rect x="{p.left}" y="{p.top}" width="{p.width}" '
    f'height="{p.height}" fill="none" stroke="#444"/>',
    f'<text x="{p.left + p.width / 2:.0f}" y="{p.top - 8}" '
    f'text-anchor="middle">{saxutils.escape(title)}</text>',
  ]
  for value in p.y_ticks(y_step):
    y = p.y(value)
    parts.append(
      f'<line x1="{p.left}" y1="{y:.1f}" x2="{p.left + p.width}" y2="{y:.1f}" stroke="#ddd"/>'
    )
    parts.append(
      f'<text x="{p.left - 4}" y="{y + 4:.1f}" text-anchor="end">{value:{y_format}}</text>'
    )
  for value, label in x_ticks:
    parts.append(
      f'<text x="{p.x(value):.1f}" y="{p.top + p.height + 16}" '
      f'text-anchor="middle">{saxutils.escape(label)}</text>'
    )
  parts.append(
    f'<text x="{p.left + p.width / 2:.0f}" '
    f'y="{p.top + p.height + 32}" text-anchor="middle">'
    f'{saxutils.escape(x_label)}</text>'
  )
  parts.append(
    f'<text transform="translate({p.left - 42},'
    f'{p.top + p.height / 2:.0f}) rotate(-90)" '
    f'text-anchor="middle">{saxutils.escape(y_label)}</text>'
  )
  return parts


def hline(
  p: Panel,
  value: float,
  color: str,
  cls: str,
  title: str,
  label: str,
  dash: str = "8,4",
  at_start: bool = False,
) -> list[str]:
  """A dashed horizontal line across the panel at `value`, labelled at its right end (or left)."""
  y = p.y(value)
  x, anchor = (p.left + 4, "start") if at_start else (p.left + p.width - 4, "end")
  return [
    f'<line class="{_attribute(cls)}" x1="{p.left}" y1="{y:.1f}" '
    f'x2="{p.left + p.width}" y2="{y:.1f}" stroke="{color}" '
    f'stroke-dasharray="{dash}"><title>{saxutils.escape(title)}'
    '</title></line>',
    f'<text x="{x}" y="{y - 5:.1f}" '
    f'text-anchor="{anchor}" fill="{color}">'
    f'{saxutils.escape(label)}</text>',
  ]


def polyline(
  p: Panel, points: Sequence[tuple[float, float]], color: str, cls: str, dash: str = ""
) -> str:
  xy = " ".join(f"{p.x(x):.1f},{p.y(y):.1f}" for x, y in points)
  dashes = f' stroke-dasharray="{dash}"' if dash else ""
  return (
    f'<polyline class="{_attribute(cls)}" points="{xy}" fill="none" '
    f'stroke="{color}" stroke-width="1.5"{dashes}/>'
  )


def whisker(p: Panel, x: float, low: float, high: float, color: str) -> str:
  """A vertical line at pixel `x` from `low` to `high` (axis values), capped: a sample's range."""
  y_low, y_high = p.y(low), p.y(high)
  return (
    f'<path d="M{x:.1f},{y_low:.1f}V{y_high:.1f}M{x - 3:.1f},{y_low:.1f}h6M{x - 3:.1f},'
    f'{y_high:.1f}h6" stroke="{color}" fill="none"/>'
  )


def marker(kind: str, x: float, y: float, color: str, title: str) -> str:
  """A point at pixel (x, y) with a tooltip.

  `kind`: "circle" (hollow), "square" or "diamond" (filled), "ring" (large,
  hollow).
  """
  tip = f"<title>{saxutils.escape(title)}</title>"
  if kind == "circle":
    return (
      f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="none" '
      f'stroke="{color}" stroke-width="1.5">{tip}</circle>'
    )
  if kind == "ring":
    return (
      f'<circle cx="{x:.1f}" cy="{y:.1f}" r="8" fill="none" '
      f'stroke="{color}" stroke-width="2">{tip}</circle>'
    )
  if kind == "diamond":
    return (
      f'<polygon points="{x:.1f},{y - 4:.1f} {x + 4:.1f},{y:.1f} '
      f'{x:.1f},{y + 4:.1f} {x - 4:.1f},{y:.1f}" fill="{color}">'
      f'{tip}</polygon>'
    )
  return (
    f'<rect x="{x - 2.5:.1f}" y="{y - 2.5:.1f}" width="5" height="5" fill="{color}">{tip}</rect>'
  )


def legend(left: float, top: float, entries: Sequence[tuple[str, str, str, str]]) -> list[str]:
  """Rows of (color, dash, marker kind or "", label); no line where dash is None."""
  parts = []
  for i, (color, dash, kind, label) in enumerate(entries):
    y = top + 16 * i
    if dash is not None:
      dashes = f' stroke-dasharray="{dash}"' if dash else ""
      parts.append(
        f'<line x1="{left}" y1="{y}" x2="{left + 30}" y2="{y}" '
        f'stroke="{color}" stroke-width="1.5"{dashes}/>'
      )
    if kind:
      parts.append(marker(kind, left + 15, y, color, ""))
    parts.append(f'<text x="{left + 38}" y="{y + 4}">{saxutils.escape(label)}</text>')
  return parts
