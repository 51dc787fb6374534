"""What the Dagster UI shows of an asset besides its value: its owner, and the column schema of a table asset,
converted from the table's one declaration (models/schemas.py `Schema`). An asset's kinds stand next to its
decorator; GPU steps get their `covlab/device` asset tag from resources/device.py: gpu_step."""

from __future__ import annotations

import textwrap

import pandas as pd
from dagster import MetadataValue, TableColumn, TableColumnConstraints, TableConstraints, TableRecord, TableSchema

from covlab.models.schemas import Schema

# The owner of every covlab asset (the UI's owner filter and catalog column).
OWNERS = ["team:covlab"]
COLUMN_SCHEMA = "dagster/column_schema"  # definition metadata entry the UI shows as the asset's columns
# Characters per line of a Markdown list shown in the UI's metadata table: the table's value column is as wide as
# its widest entry (a report's leaderboard table), wider than the panel that shows it, so a longer line runs past
# the panel's edge; 50 monospace characters fit the narrowest panel, the asset's Overview at a 1,700-pixel window.
UI_LINE = 50
# dtypes that Schema.conform never lets through missing (models/schemas.py: _cast).
NOT_NULL = ("string", "int64")


def column_schema(schema: Schema) -> TableSchema:
    """`schema` as a Dagster TableSchema: its columns in order with their dtypes, not-null where conform
    rejects missing values, and its key (unique: a one-column key on the column, a compound one on the table)."""
    single_key = schema.key[0] if len(schema.key) == 1 else None
    columns = [TableColumn(name, dtype,
                           description=_column_description(schema, name),
                           constraints=TableColumnConstraints(nullable=dtype not in NOT_NULL, unique=name == single_key))
               for name, dtype in schema.columns.items()]
    compound = [f"unique key ({', '.join(schema.key)})"] if len(schema.key) > 1 else []
    return TableSchema(columns=columns, constraints=TableConstraints(other=compound) if compound else None)


def _column_description(schema: Schema, name: str) -> str | None:
    """The column's declared description, and for an optional column what it defaults to."""
    parts = [schema.descriptions.get(name), (f"when absent: a copy of {schema.defaults[name]}"
                                             if name in schema.defaults else None)]
    return "; ".join(p for p in parts if p) or None


def table_value(schema: Schema, table: pd.DataFrame, digits: int = 3) -> MetadataValue:
    """`table` (conforming to `schema`) as a MetadataValue.table the UI shows as a table with typed columns:
    missing values as None, floats rounded to `digits` (what a reader compares; the report's CSV keeps them whole)."""
    def cell(value):
        if pd.isna(value):
            return None
        value = value.item() if hasattr(value, "item") else value
        return round(value, digits) if isinstance(value, float) else value

    records = [TableRecord({c: cell(v) for c, v in row.items()})
               for row in table[list(schema.columns)].to_dict("records")]
    return MetadataValue.table(records, schema=column_schema(schema))


def table_metadata(schema: Schema) -> dict:
    """Definition metadata of a table asset whose value conforms to `schema`."""
    return {COLUMN_SCHEMA: column_schema(schema)}


def markdown_list(lines: list[str], width: int = UI_LINE) -> MetadataValue:
    """`lines` as a Markdown list whose items break (hard line breaks, at spaces) within `width` characters, so
    that each is read whole in the Dagster UI's metadata table (UI_LINE)."""
    def item(line: str) -> str:
        return "- " + "  \n  ".join(textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False))
    return MetadataValue.md("\n".join(item(line) for line in lines))
