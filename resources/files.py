"""Strict readers for the text formats datasets arrive in (JSONL, TSV, CSV).

Each returns a DataFrame plus the line number of its first record, and raises DatasetError naming the
file, the line and what was expected on the first malformed record: broken JSON, missing fields, wrong
types, wrong field counts, non-UTF-8 bytes, empty files.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import pandas as pd

from covlab.models.dataset import Origin
from covlab.models.schemas import DatasetError

FieldTypes = dict[str, type | tuple[type, ...]]
# Integer fields become int64 columns: a value outside this range would overflow (or silently wrap) there.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INT64_RANGE = f"a 64-bit signed integer, {INT64_MIN} to {INT64_MAX}"


# The dataset files read inside a `recording_sources` block: path -> SHA-256 of the bytes read.
_SOURCES: ContextVar[dict[Path, str] | None] = ContextVar("covlab_sources_read", default=None)


@contextmanager
def recording_sources() -> Iterator[dict[Path, str]]:
    """Collects, while the block runs, every file read through `read_source` with the SHA-256 of its bytes: what
    a dataset was read from (and nothing else in its folder)."""
    token = _SOURCES.set({})
    try:
        yield _SOURCES.get()
    finally:
        _SOURCES.reset(token)


def read_source(path: Path) -> bytes:
    """The bytes of dataset file `path`, recorded with their SHA-256 inside a `recording_sources` block."""
    raw = path.read_bytes()
    sources = _SOURCES.get()
    if sources is not None:
        sources[path] = hashlib.sha256(raw).hexdigest()
    return raw


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    raw = read_source(path)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DatasetError(f"{path}:{line}: not valid UTF-8 (byte {raw[exc.start]:#04x}); "
                           "expected UTF-8 text") from None
    if not text.strip():
        raise DatasetError(f"{path}: file is empty; expected at least one record")
    # Records end at "\n" (or "\r\n") only: str.splitlines() would also break at U+2028, U+0085, \x0b, \x0c
    # and \x1c-\x1e, which JSON strings and TSV fields may hold raw, splitting a valid record in two.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_jsonl(path: Path, fields: FieldTypes, optional: FieldTypes | None = None) -> tuple[pd.DataFrame, Origin]:
    """Records of a JSON-lines file; `fields` must be present with the given types, `optional` may be."""
    optional = optional or {}
    records, numbers = [], []
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            # ValueError beyond JSONDecodeError: an integer of more than 4,300 digits; RecursionError: deep nesting.
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).split(":")[0]
            raise DatasetError(f"{path}:{number}: invalid JSON ({reason}); expected one JSON object per line") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        for name, kind in {**fields, **optional}.items():
            if name not in record:
                if name in fields:
                    raise DatasetError(f"{path}:{number}: missing field {name!r}; expected fields {sorted(fields)}")
                continue
            if not isinstance(record[name], kind) or isinstance(record[name], bool) and kind is not bool:
                raise DatasetError(f"{path}:{number}: field {name!r} must be {_type_name(kind)}, "
                                   f"got {type(record[name]).__name__} {_shown(record[name])}{_expected(kind)}")
            _check_int64(record[name], f"{path}:{number}", name)
        numbers.append(number)
        records.append({k: record.get(k) for k in {**fields, **optional}})
    if not records:
        raise DatasetError(f"{path}: no records; expected one JSON object per line")
    return pd.DataFrame.from_records(records), _origin(path, numbers)


def _origin(path: Path, numbers: list[int]) -> Origin:
    """Line arithmetic holds only when records sit on consecutive lines; else report record numbers."""
    contiguous = numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    return Origin(str(path), numbers[0] if contiguous else None)


def read_tsv(path: Path, columns: dict[str, type], header: bool | list[str] = False) -> tuple[pd.DataFrame, Origin]:
    """Tab-separated records with exactly len(columns) fields; `header` True skips a first line, a list
    also requires that first line to read exactly so."""
    lines = _lines(path)
    start = 0
    if header:
        start = 1
        if isinstance(header, list) and lines[0].split("\t") != header:
            raise DatasetError(f"{path}:1: header {lines[0]!r}; expected {chr(9).join(header)!r}")
    rows = []
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            raise DatasetError(f"{path}:{number}: blank line; expected {len(columns)} tab-separated fields")
        parts = line.split("\t")
        if len(parts) != len(columns):
            raise DatasetError(f"{path}:{number}: {len(parts)} field(s); expected {len(columns)} tab-separated "
                               f"fields ({', '.join(columns)})")
        row = {}
        for (name, kind), value in zip(columns.items(), parts):
            row[name] = _parse(value, kind, f"{path}:{number}", name)
        rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: no records after the header")
    return pd.DataFrame.from_records(rows, columns=list(columns)), Origin(str(path), start + 1)


def read_csv(path: Path, columns: dict[str, type]) -> tuple[pd.DataFrame, Origin]:
    """Comma-separated records with a header holding at least `columns` (quoted fields may span lines)."""
    lines = _lines(path)
    reader = csv.reader(io.StringIO("\n".join(lines) + "\n"))
    try:
        header = next(reader)
    except csv.Error as exc:
        raise DatasetError(f"{path}:1: unreadable CSV header ({exc})") from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise DatasetError(f"{path}:1: missing column(s) {missing}; header is {header}")
    index = {c: header.index(c) for c in columns}
    rows, line_numbers = [], []
    while True:
        start = reader.line_num + 1
        try:
            parts = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise DatasetError(f"{path}:{start}: malformed CSV ({exc})") from None
        if not parts:
            continue
        if len(parts) != len(header):
            raise DatasetError(f"{path}:{start}: {len(parts)} field(s); expected {len(header)} ({', '.join(header)})")
        rows.append({c: _parse(parts[i], columns[c], f"{path}:{start}", c) for c, i in index.items()})
        line_numbers.append(start)
    if not rows:
        raise DatasetError(f"{path}: no records after the header")
    return pd.DataFrame.from_records(rows, columns=list(columns)), _origin(path, line_numbers)


def _parse(value: str, kind: type, where: str, name: str):
    if kind is str:
        return value
    try:
        parsed = kind(value)
    except ValueError:
        raise DatasetError(f"{where}: field {name!r} must be {_type_name(kind)}, "
                           f"got {_shown(value)}{_expected(kind)}") from None
    _check_int64(parsed, where, name)
    return parsed


def _check_int64(value: object, where: str, name: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise DatasetError(f"{where}: field {name!r} is {_shown(value)}, outside the 64-bit signed integer "
                           f"range; expected {INT64_RANGE}")


def _expected(kind: type | tuple[type, ...]) -> str:
    return f"; expected {INT64_RANGE}" if kind is int else ""


def _shown(value: object) -> str:
    """repr of `value`, cut to its first 40 characters and total length when longer (a 20 MB field)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "a string", int: "an integer", float: "a number", list: "a list",
                        dict: "an object"}.get(k, k.__name__) for k in kinds)
