"""Strict readers for the text formats datasets arrive in (JSONL, TSV, CSV).

Each returns a DataFrame plus the line number of its first record, and raises DatasetError naming the
file, the line and what was expected on the first malformed record: broken JSON, missing fields, wrong
types, wrong field counts, non-UTF-8 bytes, empty files, a line longer than MAX_LINE_BYTES, and an id field
(named `_id` or `<something>_id`) that is empty or holds a tab, a line break, NUL or another control character.

A file is streamed a line at a time (`read_lines`, which resources/release_files.py reads its files with too), plain
or gzip-compressed when its name ends in `.gz`, each line read at most MAX_LINE_BYTES long, so what a reader holds
beyond its records is one line: a 2 GB file of NUL bytes is refused at line 1 after reading 64 MiB of it. Inside a
`recording_sources` block every file read is recorded with the SHA-256 of its bytes as stored.

A file that fails to parse may be anything a path or a symbolic link leads to (a credentials file): messages
quote at most EXCERPT_CHARS characters of what it holds (`excerpt`: a secret-named environment variable's value
redacted first, then cut, then escaped to printable characters), and nothing of a header that is not the
expected one.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import pandas as pd

from covlab.models.dataset import Origin
from covlab.models.schemas import DatasetError
from covlab.resources.secrets import environment_secrets, redact

FieldTypes = dict[str, type | tuple[type, ...]]
# Integer fields become int64 columns: a value outside this range would overflow (or silently wrap) there.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INT64_RANGE = f"a 64-bit signed integer, {INT64_MIN} to {INT64_MAX}"
# Longest line read, in bytes. A record's title and text hold at most 1,000,000 characters each
# (models/dataset.py: MAX_DOCUMENT_CHARS), at most 24 MB even as JSON \uXXXX escapes of surrogate pairs.
MAX_LINE_BYTES = 64 * 2**20
# Most characters of a field's value a message quotes (`excerpt`).
EXCERPT_CHARS = 40
# What an id may not hold: control characters (C0, DEL, C1: tab, line breaks, NUL, escapes) and the Unicode
# line and paragraph separators. Ids become TSV fields, run-file columns and `<doc_id>#<i>` chunk ids.
ID_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
ID_EXPECTED = "expected an id: at least one character, none of them a tab, line break, NUL or other control character"


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


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file, gzip-compressed when its name ends in `.gz`, streamed: lines end at
    "\n" (a "\r" before it is dropped), a BOM is skipped, each line is at most MAX_LINE_BYTES long (uncompressed).
    The SHA-256 of the file's bytes as stored (a gzip file's compressed bytes, hashed as they are read, bytes after
    its last member included) is recorded (`recording_sources`) once it was read to its end; a file with no text
    raises "file is empty" there."""
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    packed = path.name.endswith(".gz")
    failures = (OSError, EOFError, zlib.error) if packed else ()
    digest, number, has_text = hashlib.sha256(), 0, False
    with open(path, "rb") as stored:
        source = _Hashing(stored, digest)
        handle = gzip.GzipFile(fileobj=source, mode="rb") if packed else source
        while True:
            try:
                raw = handle.readline(MAX_LINE_BYTES + 1)
            except failures as exc:
                raise DatasetError(f"{path}:{number + 1}: not readable as gzip ({exc}); expected a gzip-compressed "
                                   "file of text lines") from None
            if not raw:
                break
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise DatasetError(f"{path}:{number}: line longer than {MAX_LINE_BYTES:,} bytes "
                                   f"({MAX_LINE_BYTES // 2**20} MiB); expected text with one record per line (a "
                                   "document's title and text hold at most 1,000,000 characters each)")
            body = raw[:-1] if raw.endswith(b"\n") else raw
            if number == 1 and body.startswith(codecs.BOM_UTF8):
                body = body[len(codecs.BOM_UTF8):]
            try:
                line = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid UTF-8 (byte {body[exc.start]:#04x}); "
                                   "expected UTF-8 text") from None
            # Records end at "\n" (or "\r\n") only: str.splitlines() would also break at U+2028, U+0085, \x0b,
            # \x0c and \x1c-\x1e, which JSON strings and TSV fields may hold raw, splitting a valid record in two.
            line = line[:-1] if line.endswith("\r") else line
            has_text = has_text or bool(line.strip())
            yield number, line
        while source.read(2**20):  # bytes after a gzip file's last member: hashed, as the file holds them
            pass
    if not has_text:
        raise DatasetError(f"{path}: file is empty; expected at least one record")
    sources = _SOURCES.get()
    if sources is not None:
        sources[path] = digest.hexdigest()


class _Hashing:
    """A binary file read through, every byte read also fed to `digest`."""

    def __init__(self, stored, digest) -> None:
        self.stored, self.digest = stored, digest

    def read(self, size: int = -1) -> bytes:
        data = self.stored.read(size)
        self.digest.update(data)
        return data

    def readline(self, size: int = -1) -> bytes:
        data = self.stored.readline(size)
        self.digest.update(data)
        return data


def read_json_objects(path: Path, expected: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, object) of a JSON-lines file (`read_lines`), one JSON object per non-blank line; `expected`, when
    given, describes one in the message about a line that is not one."""
    described = f", {expected}" if expected else ""
    for number, line in read_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            # ValueError beyond JSONDecodeError: an integer of more than 4,300 digits; RecursionError: deep nesting.
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).split(":")[0]
            raise DatasetError(f"{path}:{number}: invalid JSON ({reason}); expected one JSON object per "
                               f"line{described}") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object{described}; got {type(record).__name__}")
        yield number, record


def read_jsonl(path: Path, fields: FieldTypes, optional: FieldTypes | None = None) -> tuple[pd.DataFrame, Origin]:
    """Records of a JSON-lines file; `fields` must be present with the given types, `optional` may be."""
    optional = optional or {}
    records, numbers = [], []
    for number, record in read_json_objects(path):
        for name, kind in {**fields, **optional}.items():
            if name not in record:
                if name in fields:
                    raise DatasetError(f"{path}:{number}: missing field {name!r}; expected fields {sorted(fields)}")
                continue
            if not isinstance(record[name], kind) or isinstance(record[name], bool) and kind is not bool:
                raise DatasetError(f"{path}:{number}: field {name!r} must be {_type_name(kind)}, "
                                   f"got {type(record[name]).__name__} {excerpt(record[name])}{_expected(kind)}")
            _check_int64(record[name], f"{path}:{number}", name)
            _check_id(record[name], f"{path}:{number}", name)
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
    lines = read_lines(path)
    start = 0
    if header:
        start = 1
        _, first = next(lines)
        if isinstance(header, list) and first.split("\t") != header:
            # Nothing of the line is quoted: the file may be anything a link leads to (module docstring).
            raise DatasetError(f"{path}:1: not the header; expected the header line {chr(9).join(header)!r} "
                               f"({len(header)} tab-separated names), found {len(first.split(chr(9)))} field(s) "
                               "that differ")
    rows = []
    for number, line in lines:
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
    reader = csv.reader(line + "\n" for _, line in read_lines(path))
    try:
        header = next(reader)
    except csv.Error as exc:
        raise DatasetError(f"{path}:1: unreadable CSV header ({exc})") from None
    missing = [c for c in columns if c not in header]
    if missing:  # the header itself is not quoted: the file may be anything a link leads to
        raise DatasetError(f"{path}:1: missing column(s) {missing}; expected a header line naming "
                           f"{', '.join(columns)} (found {len(header)} other column(s))")
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
        _check_id(value, where, name)
        return value
    try:
        parsed = kind(value)
    except ValueError:
        raise DatasetError(f"{where}: field {name!r} must be {_type_name(kind)}, "
                           f"got {excerpt(value)}{_expected(kind)}") from None
    _check_int64(parsed, where, name)
    return parsed


def _check_int64(value: object, where: str, name: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise DatasetError(f"{where}: field {name!r} is {excerpt(value)}, outside the 64-bit signed integer "
                           f"range; expected {INT64_RANGE}")


def _expected(kind: type | tuple[type, ...]) -> str:
    return f"; expected {INT64_RANGE}" if kind is int else ""


def id_problem(value: str) -> str | None:
    """What makes `value` no id (ID_EXPECTED): "is empty", "holds a tab", ...; None when it is one."""
    if value == "":
        return "is empty"
    found = ID_FORBIDDEN.search(value)
    if found is None:
        return None
    char = found.group()
    kind = {"\t": "a tab", "\x00": "a NUL"}.get(char) or ("a line break" if char in "\n\r\x0b\x0c\x1c\x1d\x1e\x85"
                                                        "\u2028\u2029" else "a control character")
    return f"holds {kind}"


def is_id_field(name: str) -> bool:
    """Whether a field holds an id: `_id` (BEIR) or `<something>_id` (doc_id, query_id, arg_id, ...)."""
    return name == "_id" or name.endswith("_id")


def _check_id(value: object, where: str, name: str) -> None:
    if isinstance(value, str) and is_id_field(name) and (problem := id_problem(value)) is not None:
        raise DatasetError(f"{where}: field {name!r} {problem}; {ID_EXPECTED}, got {excerpt(value)}")


def excerpt(value: object) -> str:
    """`value` as a message quotes it: the value of every secret-named environment variable (resources/secrets.py)
    redacted, cut to its first EXCERPT_CHARS characters, escaped by repr to printable characters, with its whole
    length when it was cut (a 20 MB field, a credentials file behind a link)."""
    text = value if isinstance(value, str) else repr(value)
    text = redact(text, environment_secrets().values())
    shown = (lambda cut: repr(cut) if isinstance(value, str) else cut)(text[:EXCERPT_CHARS])
    return shown if len(text) <= EXCERPT_CHARS else f"{shown}... ({len(text):,} characters)"


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "a string", int: "an integer", float: "a number", list: "a list",
                        dict: "an object"}.get(k, k.__name__) for k in kinds)
