"""Report tables as CSV files that a spreadsheet opens without running anything in them.

A spreadsheet reads a cell that starts with =, +, -, @ (or a tab or carriage return before one) as a formula, so
an id taken from a dataset ("=HYPERLINK(...)", "@SUM(...)") would run when a report's CSV is opened. Every text
cell, index value and column name that starts with one of FORMULA_STARTS is written with a single quote in front
(OWASP, "CSV Injection"); numbers are written as they are. `write_report_csv` is how a report writes its tables
(assets/reporting.py: publish_report).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _escaped(value: object) -> object:
    return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def _escaped_index(index: pd.Index) -> pd.Index:
    if isinstance(index, pd.MultiIndex):
        return pd.MultiIndex.from_arrays([_escaped_index(index.get_level_values(level))
                                          for level in range(index.nlevels)],
                                         names=[_escaped(name) for name in index.names])
    return pd.Index([_escaped(value) for value in index], dtype=object if index.dtype == object else None,
                    name=_escaped(index.name)) if _is_text(index) or _escaped(index.name) != index.name else index


def _is_text(values: pd.Index | pd.Series) -> bool:
    return (pd.api.types.is_object_dtype(values.dtype) or pd.api.types.is_string_dtype(values.dtype)
            or isinstance(values.dtype, pd.CategoricalDtype))


def spreadsheet_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` whose text cells, index values and names (column names included) that start with one of
    FORMULA_STARTS begin with a single quote; the caller's frame is left as it is."""
    safe = frame.copy()
    for position in range(safe.shape[1]):
        column = safe.iloc[:, position]
        if _is_text(column):
            escaped = column.astype(object).map(_escaped)
            safe.isetitem(position, escaped.astype(column.dtype) if isinstance(column.dtype, pd.StringDtype)
                          else escaped)
    safe.columns = _escaped_index(safe.columns)
    safe.index = _escaped_index(safe.index)
    return safe


def write_report_csv(frame: pd.DataFrame, path: str | Path) -> None:
    """`frame` (with its index) as CSV at `path`, spreadsheet-safe (`spreadsheet_safe`), every text field in
    double quotes (also OWASP's advice; and a carriage return inside a field, which the csv module leaves unquoted
    when lines end in "\n", then stays inside its field)."""
    spreadsheet_safe(frame).to_csv(path, quoting=csv.QUOTE_NONNUMERIC)
