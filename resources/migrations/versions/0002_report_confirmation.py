"""A report materialization is confirmed once Dagster has recorded the materialization that wrote it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table("report_materializations") as batch:
        batch.add_column(sa.Column("confirmed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("report_materializations") as batch:
        batch.drop_column("confirmed_at")
