"""Content versions: one stable hash of an asset's value, so that equal versions mean equal contents.

Every asset's Dagster data version is `content_version(value)` (assets/outputs.py), and every load record
carries the version of the value read (resources/io_manager.py); staleness, the nightly re-evaluation, the
lineage audit and `covlab reproduce` compare these.

- A table hashes its column names with their dtypes and its rows as a multiset: row order and column
  order carry no meaning in covlab's tables (a ranking says its order in a `rank` column), so a table
  written in another order has the same version. Floats hash by their bits: a version survives only a
  bit-identical recomputation.
- A record (an artifact's or a registered model's value) hashes as canonical JSON without the keys that
  say where the content lives (`PLACE_KEYS`: a storage path, an MLflow URI, run id or version number),
  which differ between two stores holding the same content. Such records carry the hash of the content
  itself (`content_hash`: the weights' `directory_hash`, an index's input hash), which is hashed with them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

# Keys of a record that name a place (storage path, MLflow run, URI, registry version), not content.
PLACE_KEYS = frozenset({"path", "source", "uri", "version", "mlflow_run_id", "stored_at"})
VERSION_LENGTH = 24  # hex characters kept: 96 bits
# The folder of a model directory that holds its ONNX exports (models/runtime.py): files derived from the weights
# on a machine that runs them, verified by their own manifest, so not part of the weights' directory_hash.
EXPORTS_FOLDER = "onnx-exports"


def _cell_bytes(value) -> bytes:
    """A canonical byte string of one cell of an object column that pandas cannot hash (a list or array)."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
    return json.dumps(value, sort_keys=True, default=str).encode()


def _hashable(column: pd.Series) -> pd.Series:
    if column.dtype != object or not column.map(lambda v: isinstance(v, (list, tuple, dict, np.ndarray))).any():
        return column
    return column.map(lambda v: hashlib.sha256(_cell_bytes(v)).hexdigest())


def table_version(frame: pd.DataFrame) -> str:
    """Version of a table: column names and dtypes, and the multiset of its rows."""
    columns = sorted(frame.columns, key=str)
    digest = hashlib.sha256("|".join(f"{c}:{frame[c].dtype}" for c in columns).encode())
    if len(frame):
        canonical = pd.DataFrame({str(c): _hashable(frame[c]) for c in columns})
        rows = pd.util.hash_pandas_object(canonical, index=False).to_numpy()
        digest.update(np.sort(rows).tobytes())
    return digest.hexdigest()[:VERSION_LENGTH]


def record_version(record: dict | list) -> str:
    """Version of a JSON record; a dict's top-level PLACE_KEYS are left out."""
    if isinstance(record, dict):
        record = {k: v for k, v in record.items() if k not in PLACE_KEYS}
    text = json.dumps(record, sort_keys=True, default=str, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:VERSION_LENGTH]


def content_version(value) -> str:
    """The content version of an asset value: a table, a JSON record (dict or list), or a typed record that
    stores itself as one (`to_record()`: a trained model)."""
    if isinstance(value, pd.DataFrame):
        return table_version(value)
    if isinstance(value, (dict, list)):
        return record_version(value)
    if hasattr(value, "to_record"):
        return record_version(value.to_record())
    raise TypeError(f"no content version for a {type(value).__name__}; expected a DataFrame, dict or list")


def arrays_digest(arrays: Mapping[str, np.ndarray]):
    """A sha256 object fed each array's name, dtype, shape and bytes, in the mapping's order: equal arrays hash
    equally however they are stored (the bytes of an .npz file also hold its zip entries' times)."""
    digest = hashlib.sha256()
    for name, array in arrays.items():
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest


def directory_hash(folder: str | Path) -> str:
    """SHA-256 over the files under `folder`: each relative path with the SHA-256 of its bytes, in path order.
    Independent of where the folder lives and of file times."""
    return files_hash(file_hashes(folder))


def file_hashes(*folders: str | Path) -> dict[str, str]:
    """Relative path (with "/") -> SHA-256 of each file under `folders`, as if their files lay in one folder: a
    registered version's files are logged into one from the weights' folder and the folder of its MLflow metadata
    (resources/tracking.py). Comparing two such maps names the files that differ. A top-level EXPORTS_FOLDER is
    left out: exports are derived from the weights after registration."""
    found = {}
    for folder in folders:
        root = Path(folder)
        found.update({path.relative_to(root).as_posix(): file_hash(path) for path in root.rglob("*")
                      if path.is_file() and path.relative_to(root).parts[0] != EXPORTS_FOLDER})
    return found


def files_hash(hashes: Mapping[str, str]) -> str:
    """directory_hash of the files `file_hashes` found: each path with its file's hash, in path order (the order of
    the paths' parts, "a/x" before "a-b/x")."""
    digest = hashlib.sha256()
    for relative in sorted(hashes, key=lambda path: path.split("/")):
        digest.update(relative.encode("utf-8") + b"\0" + hashes[relative].encode())
    return digest.hexdigest()


def file_hash(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def value_differences(expected, found) -> list[str]:
    """What differs between two asset values, one line each: table shapes and columns, the largest absolute
    difference of each numeric column and the count of differing cells of the others (rows aligned by sorting
    on every column, identifiers first); for records, the keys whose values differ. Empty: equal contents."""
    if isinstance(expected, pd.DataFrame) and isinstance(found, pd.DataFrame):
        return _table_differences(expected, found)
    expected, found = (v.to_record() if hasattr(v, "to_record") else v for v in (expected, found))
    if isinstance(expected, dict) and isinstance(found, dict):
        keys = sorted((set(expected) | set(found)) - PLACE_KEYS)
        return [f"{k}: {json.dumps(expected.get(k), default=str)[:60]} vs {json.dumps(found.get(k), default=str)[:60]}"
                for k in keys if json.dumps(expected.get(k), sort_keys=True, default=str)
                != json.dumps(found.get(k), sort_keys=True, default=str)]
    if content_version(expected) == content_version(found):
        return []
    return [f"a {type(expected).__name__} vs a {type(found).__name__}"]


def _table_differences(expected: pd.DataFrame, found: pd.DataFrame) -> list[str]:
    lines = []
    if set(expected.columns) != set(found.columns):
        only = sorted(set(expected.columns) - set(found.columns)), sorted(set(found.columns) - set(expected.columns))
        lines.append(f"columns only in the recorded value: {only[0]}; only in the rebuilt one: {only[1]}")
    if len(expected) != len(found):
        return lines + [f"rows: {len(expected)} recorded vs {len(found)} rebuilt"]
    shared = [c for c in expected.columns if c in set(found.columns)]
    numeric = [c for c in shared if pd.api.types.is_numeric_dtype(expected[c])
               and pd.api.types.is_numeric_dtype(found[c]) and not pd.api.types.is_bool_dtype(expected[c])]
    others = [c for c in shared if c not in numeric]

    def aligned(frame: pd.DataFrame) -> pd.DataFrame:
        canonical = pd.DataFrame({c: _hashable(frame[c]) for c in shared})
        return canonical.sort_values(others + numeric, kind="stable").reset_index(drop=True)

    left, right = aligned(expected), aligned(found)
    for column in shared:
        if column in numeric:
            a, b = left[column].astype("float64").to_numpy(), right[column].astype("float64").to_numpy()
            both_nan = np.isnan(a) & np.isnan(b)
            gap = np.where(both_nan, 0.0, np.abs(a - b))
            if np.isnan(gap).any() or gap.max(initial=0.0) > 0:
                lines.append(f"{column}: max |difference| {np.nanmax(gap, initial=0.0):.6g}"
                             + (f", {int(np.isnan(gap).sum())} missing on one side" if np.isnan(gap).any() else ""))
        else:
            differing = int((left[column].astype(str) != right[column].astype(str)).sum())
            if differing:
                lines.append(f"{column}: {differing} of {len(left)} cells differ")
    if not lines and str(expected.dtypes.to_dict()) != str(found.dtypes.to_dict()):
        lines.append(f"dtypes: {expected.dtypes.astype(str).to_dict()} vs {found.dtypes.astype(str).to_dict()}")
    return lines
