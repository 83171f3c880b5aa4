"""Tests for markdown_table: the text the results pages hold, read back by a Markdown parser."""

import re

from absl.testing import absltest
import markdown_it

from testing.benchmarks.lib import markdown_table


def _parsed(lines: list[str]) -> tuple[list[list[str]], list[str]]:
  """The cells of each row (the header first) and each column's alignment, as a parser reads them."""
  html = markdown_it.MarkdownIt("commonmark").enable("table").render("\n".join(lines) + "\n")
  rows = [
    [cell for _, cell in re.findall(r"<(th|td)[^>]*>(.*?)</\1>", row)]
    for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)
  ]
  aligns = re.findall(r"<th(?: style=\"text-align:(\w+)\")?>", html)
  return rows, aligns


class MarkdownTableTest(absltest.TestCase):
  def test_rows_are_written_as_given_one_line_each_without_padding(self):
    self.assertEqual(
      markdown_table.lines(["T", "step (ms)"], [[256, "1.50"], ["4096", "12.25 [1.0–2.0]"]]),
      ["| T | step (ms) |", "| --- | --- |", "| 256 | 1.50 |", "| 4096 | 12.25 [1.0–2.0] |"],
    )

  def test_a_parser_reads_the_cells_and_the_alignment(self):
    header = ["model", "budget (KiB)", "", "plan"]
    rows = [["mlp", "1,024.0", "", "binomial, 3 slots"], ["lstm", "0.5", "n/a", "True"]]
    lines = markdown_table.lines(header, rows, align="lrll")
    self.assertEqual(_parsed(lines), ([header] + rows, ["", "right", "", ""]))
    self.assertEqual(lines[1], "| --- | ---: | --- | --- |")

  def test_numbers_keep_the_text_they_were_given(self):
    # tabulate alone would parse "1.50" as a number and write 1.5.
    self.assertEqual(markdown_table.lines(["a", "b"], [["1.50", 2.0]])[2], "| 1.50 | 2.0 |")

  def test_a_header_without_rows(self):
    self.assertEqual(markdown_table.lines(["a", "b"], []), ["| a | b |", "| --- | --- |"])

  def test_refuses_what_would_not_read_back(self):
    with self.assertRaisesRegex(ValueError, r"a cell holds '\|'"):
      markdown_table.lines(["row"], [["mlp | 16"]])
    with self.assertRaisesRegex(ValueError, "has 1 cells, the header 2"):
      markdown_table.lines(["a", "b"], [["x"]])
    with self.assertRaisesRegex(ValueError, "one of 'l' or 'r' per column"):
      markdown_table.lines(["a", "b"], [], align="l")
    with self.assertRaisesRegex(ValueError, "one of 'l' or 'r' per column"):
      markdown_table.lines(["a"], [], align="c")


if __name__ == "__main__":
  absltest.main()
