"""What an in-process run (`covlab demo`, `covlab materialize`) prints while it runs, on stderr.

One line per finished step: each asset it built, its partition, the step's seconds and the asset's key
figures (`key_figures`, also the CLI's final summary); the steps' own messages (device, registered models,
warnings), of which progress reports (models/encoders.py ProgressReport, logged with their fields by
assets/progress.py) only for long loops: at most one per `PROGRESS_EVERY_S` seconds of a step, and the
loop's last one once an earlier one was shown. Dagster's
per-event chatter (step started, output handled, ...) stays out of the console; it stays in the instance's
event log, which the UI shows. So do failures and their tracebacks: the CLI says why a run failed in one line
(orchestration/failures.py). With the logger's `log_level` at DEBUG everything is printed, as Dagster's own
console logger prints it.

    09:29:31 coverage_estimator: cross-encoder epoch 1/1: 592/1184 (50%), 23.0 pairs/s, ETA 26s
    09:29:31 coverage_estimator [demo] built in 45.2 s: train_pairs=1184, dev_auc=0.9408, model_uri=...
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Mapping

from dagster import DagsterEventType, Field, logger
from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR  # the Dagster metadata of a log record

from covlab.assets.progress import PROGRESS_RECORD

# Metadata entries that say what a materialization holds, in this order, where an asset records them.
KEY_FIGURES = ("rows", "pairs", "documents", "queries", "subquestions", "train_pairs", "dev_auc", "groups",
               "model_uri")
PROGRESS_EVERY_S = 10.0
# Events whose message carries a failed run's traceback: not printed (the CLI prints the cause in one line).
FAILURES = (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE, DagsterEventType.RESOURCE_INIT_FAILURE)
TIME_FORMAT = "%H:%M:%S"


def key_figures(metadata: Mapping) -> str:
    """`rows=348, queries=14`: the KEY_FIGURES entries of a materialization's metadata (name -> MetadataValue)."""
    values = {k: metadata[k].value for k in KEY_FIGURES if k in metadata}
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


class RunConsole(logging.Handler):
    """Formats a run's log records as described in the module docstring; the records come from Dagster's
    log manager (`covlab_console` below), each with its Dagster metadata (step, event)."""

    def __init__(self, level: int = logging.INFO, stream=None, every_s: float = PROGRESS_EVERY_S):
        super().__init__(logging.DEBUG)
        self.threshold, self.stream, self.every_s = level, stream, every_s
        self.built: dict[str, list] = defaultdict(list)  # step -> materializations so far
        self.checks: dict[str, list] = defaultdict(list)  # step -> asset check evaluations so far
        self.shown_at: dict[str, float] = {}  # step -> when it started or last showed a progress message
        self.shown_labels: set[tuple[str, str]] = set()  # (step, progress label) with a message shown

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.line(record)
            if line is not None:
                stream = self.stream or sys.stderr
                stream.write(f"{time.strftime(TIME_FORMAT, time.localtime(record.created))} {line}\n")
                stream.flush()
        except Exception:
            self.handleError(record)

    def line(self, record: logging.LogRecord) -> str | None:
        """The text to print for `record` (after the time), or None to print nothing."""
        meta = getattr(record, LOG_RECORD_METADATA_ATTR, None) or {}
        event, step = meta.get("dagster_event"), meta.get("step_key")
        message = meta.get("orig_message", record.getMessage())
        if self.threshold <= logging.DEBUG:
            return record.getMessage()
        if event is None:  # a step's (or resource's) own message
            progress = getattr(record, PROGRESS_RECORD, None)
            if record.levelno < self.threshold or (progress is not None
                                                   and not self.progress_due(step, progress, record.created)):
                return None
            return f"{step or 'run'}: {_level(record)}{message}"
        kind = event.event_type
        if kind == DagsterEventType.STEP_START:
            self.shown_at[step] = record.created
        elif kind == DagsterEventType.ASSET_MATERIALIZATION:
            self.built[step].append(event.step_materialization_data.materialization)
        elif kind == DagsterEventType.ASSET_CHECK_EVALUATION:
            self.checks[step].append(event.asset_check_evaluation_data)
        elif kind == DagsterEventType.STEP_SUCCESS:
            return self.step_done(step, event.step_success_data.duration_ms / 1000)
        elif kind in FAILURES:  # the CLI says why in one line (orchestration/failures.py); the event log keeps all
            return None
        elif record.levelno >= logging.WARNING:  # retries, engine errors: Dagster's message
            return record.getMessage()
        return None

    def step_done(self, step: str, seconds: float) -> str:
        """A line per asset the step built, and per check it evaluated: all of a check-only step's, the
        failed ones of a step that also built assets (the final summary lists every check)."""
        built, checks = self.built.pop(step, []), self.checks.pop(step, [])
        self.shown_at.pop(step, None)
        lines = [f"{m.asset_key.to_user_string()}{f' [{m.partition}]' if m.partition else ''} built in {seconds:.1f} s"
                 + (f": {figures}" if (figures := key_figures(m.metadata)) else "") for m in built]
        lines += [f"check {c.check_name} of {c.asset_key.to_user_string()} "
                  f"{'passed' if c.passed else 'did not pass'}" + ("" if built else f" in {seconds:.1f} s")
                  for c in checks if not (c.passed and built)]
        return "\n         ".join(lines) if lines else f"{step}: done in {seconds:.1f} s, nothing materialized"

    def progress_due(self, step: str | None, progress: dict, now: float) -> bool:
        """Whether to show a progress report (ProgressReport's fields: label, done, total, ...): once
        `every_s` seconds have passed since the step started or last showed one, and a loop's last report
        when one of that loop was shown before."""
        key = (step, progress["label"])
        finished = progress["done"] >= progress["total"]
        if finished and key in self.shown_labels:
            self.shown_labels.discard(key)
            self.shown_at[step] = now
            return True
        if now - self.shown_at.setdefault(step, now) >= self.every_s:
            if not finished:
                self.shown_labels.add(key)
            self.shown_at[step] = now
            return True
        return False


def _level(record: logging.LogRecord) -> str:
    return "" if record.levelno < logging.WARNING else f"{record.levelname}: "


class SourceFormatter(logging.Formatter):
    """`09:28:24 covlab: WARNING: message`: a Python logger's records in the console's layout."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime(TIME_FORMAT, time.localtime(record.created))
        return f"{when} {self.source}: {_level(record)}{record.getMessage()}"


@logger(config_schema={"log_level": Field(str, is_required=False, default_value="INFO",
                                          description="INFO: step lines, the steps' messages and long-loop progress; "
                                                      "DEBUG: every Dagster event too")},
        description="covlab's console: one line per finished step with its key figures (orchestration/console.py)")
def covlab_console(init_context) -> logging.Logger:
    level = logging.getLevelName(init_context.logger_config["log_level"].upper())
    if not isinstance(level, int):
        raise ValueError(f"log_level {init_context.logger_config['log_level']!r}: expected DEBUG, INFO, WARNING or "
                         "ERROR")
    console = logging.getLoggerClass()("covlab.run", level=logging.DEBUG)
    console.addHandler(RunConsole(level, stream=_terminal(sys.stderr)))
    return console


def _terminal(stream):
    """A stream on what `stream` writes to now, before the run starts. While an in-process run executes,
    Dagster points the process's stdout and stderr at the run's capture file and copies that back with
    `tail -F`, which polls once a second and is stopped when the run ends: a run's last lines would be lost
    (dagster-io/dagster#23336). `stream` itself where it has no file descriptor (a test's capture)."""
    try:
        return os.fdopen(os.dup(stream.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return stream
