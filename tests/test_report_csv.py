"""Report tables exported as CSV cannot inject spreadsheet formulas: a cell, index value or column name that
starts with =, +, -, @, a tab or a carriage return is written with a leading single quote (OWASP's rule for
CSV injection), numbers are written as numbers, and every report CSV is written through that one function."""

import csv
import re
from pathlib import Path

import pandas as pd

from covlab.resources.csv_export import FORMULA_STARTS, spreadsheet_safe, write_report_csv

DANGEROUS = ["=HYPERLINK(\"http://evil.example\",\"x\")", "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(1,2)", "\tx", "\rx"]


def test_cells_index_and_names_that_start_a_formula_are_written_behind_a_quote(tmp_path):
    frame = pd.DataFrame({"query_id": [*DANGEROUS, "q1"], "method": "mmr", "score": [-0.5] * 7, "n": range(7)},
                         index=pd.Index([*DANGEROUS, "fine"], name="=row"))
    frame = frame.rename(columns={"method": "@method"})
    target = tmp_path / "per_query.csv"
    write_report_csv(frame, target)
    with open(target, newline="", encoding="utf-8") as handle:
        header, *rows = list(csv.reader(handle))
    assert header == ["'=row", "query_id", "'@method", "score", "n"]
    assert [row[0] for row in rows] == [f"'{value}" for value in DANGEROUS] + ["fine"]
    assert [row[1] for row in rows] == [f"'{value}" for value in DANGEROUS] + ["q1"]
    assert {row[2] for row in rows} == {"mmr"}
    assert {row[3] for row in rows} == {"-0.5"} and [row[4] for row in rows] == [str(i) for i in range(7)]
    assert all(not re.match(r"[=+\-@\t\r]", cell) or cell == "-0.5" for row in rows for cell in row)
    assert frame.index[0] == DANGEROUS[0] and frame["query_id"].iloc[0] == DANGEROUS[0]  # the caller's table is untouched


def test_a_multiindex_and_categories_are_escaped_too():
    frame = pd.DataFrame({"value": [1.0, 2.0], "label": pd.Categorical(["=1+1", "ok"])},
                         index=pd.MultiIndex.from_tuples([("=a", 1), ("b", 2)], names=["method", "k"]))
    safe = spreadsheet_safe(frame)
    assert list(safe.index) == [("'=a", 1), ("b", 2)] and list(safe["label"]) == ["'=1+1", "ok"]
    assert safe["value"].tolist() == [1.0, 2.0] and set(FORMULA_STARTS) == set("=+-@\t\r")


def test_every_report_csv_is_written_through_the_safe_writer():
    """No other `to_csv` in the pipeline's code: a report table cannot reach a CSV unescaped."""
    root = Path(__file__).resolve().parents[1]
    writers = [f"{path.relative_to(root)}:{number}" for folder in ("assets", "resources", "models")
               for path in sorted((root / folder).rglob("*.py"))
               for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
               if ".to_csv(" in line]
    assert writers == ["resources/csv_export.py:" + writers[0].rsplit(":", 1)[1]] if writers else False, writers
    reporting = (root / "assets" / "reporting.py").read_text(encoding="utf-8")
    assert "write_report_csv(" in reporting
