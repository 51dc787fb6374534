"""Storage of asset values on a filesystem: tables as Parquet, small records as JSON.

Every write goes to a temporary file in the target directory and is renamed into place, so a failed
step never leaves a half-written artifact and never damages the previous materialization.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
from dagster import ConfigurableIOManager, InputContext, OutputContext
from pydantic import Field


def atomic_write(target: Path, write) -> None:
    """Call `write(tmp_path)`, then rename the file onto `target`; the temporary file is removed on error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class LocalTableIOManager(ConfigurableIOManager):
    """DataFrames -> `<base>/<asset key>/<partition>.parquet`; dicts and lists -> `.json` beside them."""

    base_dir: str = Field(description="root folder of stored asset values (a local path)")

    def _stem(self, context: InputContext | OutputContext) -> Path:
        key = context.asset_key.path
        partition = context.asset_partition_key if context.has_asset_partitions else "__all__"
        return Path(self.base_dir).joinpath(*key) / partition

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        if obj is None:
            return
        stem = self._stem(context)
        if isinstance(obj, pd.DataFrame):
            path = stem.with_suffix(".parquet")
            atomic_write(path, lambda tmp: obj.to_parquet(tmp, index=False))
        elif isinstance(obj, (dict, list)):
            path = stem.with_suffix(".json")
            atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str)))
        else:
            raise TypeError(f"{context.asset_key.to_user_string()}: cannot store a {type(obj).__name__}; "
                            "expected a DataFrame, dict or list")
        context.add_output_metadata({"stored_at": str(path)})

    def load_input(self, context: InputContext) -> Any:
        stem = self._stem(context)
        if stem.with_suffix(".parquet").exists():
            return pd.read_parquet(stem.with_suffix(".parquet"))
        if stem.with_suffix(".json").exists():
            return json.loads(stem.with_suffix(".json").read_text())
        raise FileNotFoundError(f"{context.asset_key.to_user_string()} partition "
                                f"{context.asset_partition_key if context.has_asset_partitions else ''!r}: "
                                f"nothing stored at {stem}.parquet or .json; materialize it first")
