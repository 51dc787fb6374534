"""Progress of a long step as structured log records: a step's progress callback (`step_progress`) logs each
models/encoders.py ProgressReport as its message, with its fields attached to the log record under
PROGRESS_RECORD, so that the console (orchestration/console.py) decides what to show from the fields, never
by parsing the text. Plain messages pass through as they are."""

from __future__ import annotations

from collections.abc import Callable

from covlab.models.encoders import ProgressReport

# The log record attribute that carries a ProgressReport's fields (Dagster passes `extra` on to every logger).
PROGRESS_RECORD = "covlab_progress"


def step_progress(context) -> Callable[[object], None]:
    """The progress callback of a running step: a ProgressReport is logged with its fields, anything else as
    its text."""
    def report(event: object) -> None:
        if isinstance(event, ProgressReport):
            context.log.info(str(event), extra={PROGRESS_RECORD: event.to_dict()})
        else:
            context.log.info(str(event))

    return report
