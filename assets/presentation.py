"""What the Dagster UI shows of an asset besides its value: its owner, and the column schema of a table asset,
converted from the table's one declaration (models/schemas.py `Schema`). An asset's kinds stand next to its
decorator; GPU steps get their `covlab/device` asset tag from resources/device.py: gpu_step."""

from __future__ import annotations

from dagster import TableColumn, TableColumnConstraints, TableConstraints, TableSchema

from covlab.models.schemas import Schema

# The owner of every covlab asset (the UI's owner filter and catalog column).
OWNERS = ["team:covlab"]
COLUMN_SCHEMA = "dagster/column_schema"  # definition metadata entry the UI shows as the asset's columns
# dtypes that Schema.conform never lets through missing (models/schemas.py: _cast).
NOT_NULL = ("string", "int64")


def column_schema(schema: Schema) -> TableSchema:
    """`schema` as a Dagster TableSchema: its columns in order with their dtypes, not-null where conform
    rejects missing values, and its key (unique: a one-column key on the column, a compound one on the table)."""
    single_key = schema.key[0] if len(schema.key) == 1 else None
    columns = [TableColumn(name, dtype,
                           description=(f"when absent: a copy of {schema.defaults[name]}"
                                        if name in schema.defaults else None),
                           constraints=TableColumnConstraints(nullable=dtype not in NOT_NULL, unique=name == single_key))
               for name, dtype in schema.columns.items()]
    compound = [f"unique key ({', '.join(schema.key)})"] if len(schema.key) > 1 else []
    return TableSchema(columns=columns, constraints=TableConstraints(other=compound) if compound else None)


def table_metadata(schema: Schema) -> dict:
    """Definition metadata of a table asset whose value conforms to `schema`."""
    return {COLUMN_SCHEMA: column_schema(schema)}
