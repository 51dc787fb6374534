"""The one way an asset returns its value: an Output whose data version is the value's content version
(models/versions.py), so that equal data versions mean equal contents, and whose metadata records the
source code that ran (resources/source.py) and what else can change float results between machines."""

from __future__ import annotations

import platform
import sys
import warnings

import pandas as pd
from dagster import BetaWarning, DataVersion, MetadataValue, Output

from covlab.models.versions import content_version
from covlab.resources.source import RUNTIME_METADATA, SOURCE_METADATA, source_state

ROW_COUNT = "dagster/row_count"  # metadata entry of every table materialization (the UI's row count)


def runtime() -> dict:
    described = {"python": platform.python_version(), "machine": platform.machine()}
    torch = sys.modules.get("torch")  # only when this step imported it: no import for steps that do not
    if torch is not None:
        described.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return described


def content_output(value, metadata: dict | None = None, output_name: str = "result") -> Output:
    """`value` (a DataFrame, or a JSON record) as the Output named `output_name`, versioned by content; a
    DataFrame's row count recorded as `dagster/row_count`."""
    rows = {ROW_COUNT: len(value)} if isinstance(value, pd.DataFrame) else {}
    with warnings.catch_warnings():
        # Dagster 1.13 marks Output's `data_version` beta and warns on every call; content-hash data versions
        # are what covlab's lineage is built on, so that one warning is silenced, here only.
        warnings.filterwarnings("ignore", message=r"Parameter `data_version` of initializer `Output\.__init__`",
                                category=BetaWarning)
        return Output(value, output_name=output_name, data_version=DataVersion(content_version(value)),
                      metadata={**(metadata or {}), **rows,
                                SOURCE_METADATA: MetadataValue.json(source_state().to_dict()),
                                RUNTIME_METADATA: MetadataValue.json(runtime())})
