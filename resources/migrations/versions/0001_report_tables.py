"""Report materializations and their figures.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "report_materializations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dataset", sa.String(255), nullable=False),
        sa.Column("report_asset", sa.String(255), nullable=False),
        sa.Column("partition", sa.String(255), nullable=False),
        sa.Column("run_id", sa.String(255), nullable=False),
        sa.Column("code_version", sa.String(255), nullable=False),
        sa.Column("data_version", sa.String(255), nullable=True),
        sa.Column("config", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_report_materializations"),
    )
    op.create_index("ix_report_materializations_dataset_report_asset", "report_materializations",
                    ["dataset", "report_asset"])
    op.create_index("ix_report_materializations_run_id", "report_materializations", ["run_id"])
    op.create_table(
        "report_figures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("materialization_id", sa.Integer(), nullable=False),
        sa.Column("dataset", sa.String(255), nullable=False),
        sa.Column("method", sa.String(255), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=True),
        sa.Column("k", sa.Integer(), nullable=True),
        sa.Column("split", sa.String(255), nullable=True),
        sa.Column("metric", sa.String(255), nullable=False),
        sa.Column("query_id", sa.String(255), nullable=True),
        sa.Column("value", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_report_figures"),
        sa.ForeignKeyConstraint(["materialization_id"], ["report_materializations.id"],
                                name="fk_report_figures_materialization_id_report_materializations"),
    )
    op.create_index("ix_report_figures_dataset_method_metric", "report_figures", ["dataset", "method", "metric"])
    op.create_index("ix_report_figures_value", "report_figures", ["value"])
    op.create_index("ix_report_figures_materialization_id", "report_figures", ["materialization_id"])


def downgrade() -> None:
    op.drop_table("report_figures")
    op.drop_table("report_materializations")
