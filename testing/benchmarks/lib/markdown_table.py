"""Markdown tables, the benchmarks' one table writer: `tabulate` (pinned), cells as given.

Every table the benchmarks write goes through `lines`: `| a | b |` rows, no padding to a column's
width (the results pages' diffs stay one row per changed figure), `---` under the header, `---:`
for a right-aligned column.
"""

from typing import Iterable, Sequence

import tabulate


def _table_format(align: str) -> tabulate.TableFormat:
  """GitHub's pipe table with the line under the header written from `align`, not the widths."""
  rule = "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |"
  row = tabulate.DataRow("|", "|", "|")
  return tabulate.TableFormat(
    lineabove=None,
    linebelowheader=lambda widths, aligns: rule,
    linebetweenrows=None,
    linebelow=None,
    headerrow=row,
    datarow=row,
    padding=1,
    with_header_hide=None,
  )


def lines(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
  """A Markdown table's lines: the header, its rule, then one line per row.

  Args:
    header: the columns' titles.
    rows: the cells, one sequence per row, each as long as `header`; `str()` of each is written
      as it is (no number formatting, no padding). A cell must not contain `|`.
    align: one letter per column, `l` (left, the default) or `r` (right: `---:`); empty: all left.

  Returns:
    The table's lines, without newlines.

  >>> lines(["T", "ms"], [[256, "1.50"]], align="lr")
  ['| T | ms |', '| --- | ---: |', '| 256 | 1.50 |']
  """
  align = align or "l" * len(header)
  rows = [list(r) for r in rows]
  if len(align) != len(header) or set(align) - {"l", "r"}:
    raise ValueError(f"align {align!r}: one of 'l' or 'r' per column of {list(header)}")
  for r in rows:
    if len(r) != len(header):
      raise ValueError(f"row {r} has {len(r)} cells, the header {len(header)}: {list(header)}")
    if any("|" in str(cell) for cell in r):
      raise ValueError(f"row {r}: a cell holds '|', which would split it")
  text = tabulate.tabulate(
    [[str(c) for c in r] for r in rows],
    headers=list(header),
    tablefmt=_table_format(align),
    disable_numparse=True,
    numalign=None,
    stralign=None,
  )
  return text.split("\n")
