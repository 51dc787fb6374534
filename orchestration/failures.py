"""What a failed in-process run says on the command line: one line, the cause first.

A run that `covlab materialize` or `covlab demo` executes raises its step's error out of Dagster when it fails,
and Python would print that error's whole chain: 100 to 460 lines in which the cause is buried. The CLI prints
one line instead (`failure_line`):

- an invalid asset config or resource setting (a pydantic validation error) names the asset or resource, each
  key, what was expected and what was given;
- a full filesystem (ENOSPC, or SQLite's "database or disk is full") names the filesystem, its size and free
  space, and the file being written;
- any other error names the failed step and the error's own message.

The traceback stays where Dagster recorded it, in the run's event log (the run's page in the UI).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path

from dagster import Config, DagsterError, DagsterEventType, DagsterInstance
from pydantic import ValidationError

from covlab.resources.tracking import SECRET_NAME_PATTERN

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
SQLITE_FULL = 13  # sqlite3's SQLITE_FULL result code: "database or disk is full"
MESSAGE_CHARS = 600  # an error message is cut to this many characters on the command line


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and everything behind it, outermost first, each once: the user exception a Dagster error wraps,
    the explicit cause and the exception being handled when it was raised."""
    chain, seen, todo = [], set(), [error]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        todo += [getattr(current, "user_exception", None), current.__cause__, current.__context__]
    return chain


def invalid_config(error: BaseException):
    """The pydantic validation error behind `error` that refused a Dagster config (an asset's config or a
    resource's settings: a `dagster.Config` subclass), or None."""
    configs = {cls.__name__ for cls in _subclasses(Config)}
    return next((e for e in error_chain(error) if isinstance(e, ValidationError) and e.title in configs), None)


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(sub) for sub in found))


def failure_line(error: BaseException, instance: DagsterInstance, run_id: str,
                 resources: Mapping[str, object]) -> str:
    """One line saying why run `run_id` failed with `error` (module docstring); `resources` are the run's
    resources by key, which name the owner of an invalid setting."""
    chain = error_chain(error)
    step = failed_step(instance, run_id)
    where = f"run {run_id}" + (f", step {step}" if step else "")
    full = disk_full(chain)
    if full is not None:
        return f"{full} ({where})"
    invalid = invalid_config(error)
    if invalid is not None:
        owner = next((f"resource {key}" for key, resource in resources.items()
                      if type(resource).__name__ == invalid.title), None)
        stopped = "set-up failed: no step ran" if owner else "the step did not run"
        owner = owner or (f"asset {step} config" if step else invalid.title)
        return f"{owner}: {validation_problems(invalid)} ({where}: {stopped})"
    cause = next((e for e in chain if not isinstance(e, DagsterError)), error)
    return (f"{where} failed: {type(cause).__name__}: {one_line(str(cause))} (the traceback is in the run's "
            "event log: its page in the Dagster UI)")


def failed_step(instance: DagsterInstance, run_id: str) -> str | None:
    """The step of `run_id` that failed (its last STEP_FAILURE), else the last one started; None when the event
    log has neither (a run that failed setting up, or one whose events could not be written)."""
    try:
        records = instance.get_records_for_run(run_id, of_type={DagsterEventType.STEP_FAILURE,
                                                                DagsterEventType.STEP_START}).records
    except Exception:  # an unreadable event log must not hide the failure being reported
        return None
    failures = [r.event_log_entry.step_key for r in records
                if r.event_log_entry.dagster_event_type == DagsterEventType.STEP_FAILURE]
    started = [r.event_log_entry.step_key for r in records]
    return (failures or started or [None])[-1]


def validation_problems(error) -> str:
    """`token_budgets: token budgets must be ...; got [0]; mmr_lambda: ...`: each problem of a pydantic
    ValidationError as its key, what was expected and the value given (never a secret's)."""
    problems = []
    for problem in error.errors(include_url=False):
        key = ".".join(str(part) for part in problem["loc"]) or "(the whole config)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] != "value_error":  # pydantic's own messages do not repeat the value
            shown = "[redacted]" if re.search(SECRET_NAME_PATTERN, key) else _shown(problem.get("input"))
            message += f"; got {shown}"
        problems.append(f"{key}: {message}")
    return "; ".join(problems)


def disk_full(chain: list[BaseException]) -> str | None:
    """The line for a write that found its filesystem full, or None when nothing in `chain` says so."""
    from covlab.resources.home import covlab_home

    written = next((e for e in chain if isinstance(e, OSError) and e.errno in NO_SPACE), None)
    if written is not None:
        target = written.filename2 or written.filename
        what = f"writing {target}" if target else "a write"
        return (f"no space left on device: {filesystem(target or covlab_home())} filled up; {what} failed (the "
                "partial file is removed). Free space there and run again: what earlier runs stored is intact")
    database = next((e for e in chain if getattr(e, "sqlite_errorcode", None) == SQLITE_FULL
                     or "database or disk is full" in str(e)), None)
    if database is not None:
        return (f"no space left on device: a SQLite database could not grow ({one_line(str(database))}); "
                f"COVLAB_HOME is on {filesystem(covlab_home())}. Free space there and run again: what earlier "
                "runs stored is intact")
    return None


def filesystem(path: str | os.PathLike) -> str:
    """`the filesystem at /mnt/small (tmpfs, 62.9 MB, 0 B free now)`: the mount point holding `path` (the nearest
    existing folder, for a file that is gone), its type, size and free space."""
    where = Path(os.path.abspath(path))
    while not where.exists() and where != where.parent:
        where = where.parent
    mount = where
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    stats = os.statvfs(mount)
    details = [_mount_type(mount), f"{_size(stats.f_frsize * stats.f_blocks)}",
               f"{_size(stats.f_frsize * stats.f_bavail)} free now"]
    return f"the filesystem at {mount} ({', '.join(d for d in details if d)})"


def _mount_type(mount: Path) -> str | None:
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    types = {fields[1]: fields[2] for fields in (line.split() for line in lines) if len(fields) > 2}
    return types.get(str(mount))


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def one_line(text: str) -> str:
    """`text` on one line (whitespace runs as one space), cut to MESSAGE_CHARS characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MESSAGE_CHARS else flat[:MESSAGE_CHARS] + "..."


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"

