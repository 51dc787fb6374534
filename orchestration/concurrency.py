"""Concurrency-pool slots and the runs that hold them.

GPU steps share the `gpu` pool (resources/device.py: gpu_step), limited to one slot in the generated
dagster.yaml. A run claims the slot in the instance's event log storage and frees it when its step ends;
a run whose process is killed (`kill -9`, OOM killer, a closed laptop) never does, and Dagster keeps the
slot claimed even after the run is marked failed. Every later GPU step then waits forever.

`covlab` runs execute in-process, so the process that runs a run is the CLI process: the CLI tags each run
with its pid and host (`launch_tags`), and `free_stale_slots` frees the slots of runs that are over or whose
process is gone from this host. Runs launched by the webserver or a schedule are freed by Dagster's run
monitoring once they are marked ended (dagster.yaml: `free_slots_after_run_end_seconds`).

A run killed outside any pool (a CPU step) holds no slot but would stay STARTED for good: `end_dead_runs`
marks every run of this host whose covlab process is gone as failed, before each CLI launch.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

RUN_PID_TAG = "covlab/pid"
RUN_HOST_TAG = "covlab/host"
WAIT_CHECK_SECONDS = 10.0

log = logging.getLogger("covlab.concurrency")


def launch_tags() -> dict[str, str]:
    """Run tags naming this process, which executes the run in-process, so that a later cleanup can tell
    whether the run is still alive."""
    return {RUN_PID_TAG: str(os.getpid()), RUN_HOST_TAG: socket.gethostname()}


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host and is not a zombie (killed, waiting to be reaped)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no procfs: os.kill is all we know


@dataclass(frozen=True)
class SlotHolder:
    """A run with claims in concurrency pools: the (pool, step) pairs holding a slot and those waiting."""

    run_id: str
    run: DagsterRun | None  # None when the run record was deleted
    holding: tuple[tuple[str, str], ...]
    waiting: tuple[tuple[str, str], ...]

    @property
    def pid(self) -> int | None:
        value = self.run.tags.get(RUN_PID_TAG) if self.run else None
        return int(value) if value and value.isdigit() else None

    @property
    def host(self) -> str | None:
        return self.run.tags.get(RUN_HOST_TAG) if self.run else None

    @property
    def in_this_process(self) -> bool:
        return self.pid == os.getpid() and self.host == socket.gethostname()

    @property
    def alive(self) -> bool | None:
        """False when the run is over (finished, deleted) or its process is gone from this host; True when
        its process runs here; None when nothing tells (no covlab pid tag, or another host)."""
        if self.run is None or self.run.is_finished:
            return False
        if self.pid is None or self.host != socket.gethostname():
            return None
        return process_alive(self.pid)

    def describe(self) -> str:
        """One line: the run, its claims, its status and whether it is alive."""
        claims = ", ".join([f"holds {pool!r} ({step})" for pool, step in self.holding]
                           + [f"waits for {pool!r} ({step})" for pool, step in self.waiting])
        status = self.run.status.value if self.run else "deleted"
        where = f", pid {self.pid} on {self.host}" if self.pid is not None and self.host else ""
        state = {True: "running", False: "gone"}.get(self.alive, "cannot tell whether it is alive")
        return f"run {self.run_id}: {claims} [{status}{where}: {state}]"


@dataclass(frozen=True)
class PoolSlots:
    """The instance's pools: their limits and every run holding or waiting for a slot."""

    limits: dict[str, int | None] = field(default_factory=dict)
    holders: list[SlotHolder] = field(default_factory=list)

    def holding(self, pool: str) -> list[SlotHolder]:
        return [h for h in self.holders if any(p == pool for p, _ in h.holding)]


def pool_slots(instance: DagsterInstance) -> PoolSlots:
    """Who holds and who waits for each pool's slots. A pending claim that Dagster has already assigned
    a slot counts as holding it (the slot is reserved for that step)."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return PoolSlots()
    infos = storage.get_concurrency_infos(sorted(storage.get_concurrency_keys()))
    holding: dict[str, set] = defaultdict(set)
    waiting: dict[str, set] = defaultdict(set)
    for pool, info in infos.items():
        for slot in info.claimed_slots:
            holding[slot.run_id].add((pool, slot.step_key))
        for step in info.pending_steps:
            (holding if step.assigned_timestamp else waiting)[step.run_id].add((pool, step.step_key))
    run_ids = sorted(set(holding) | set(waiting))
    runs = {record.dagster_run.run_id: record.dagster_run
            for record in instance.get_run_records(RunsFilter(run_ids=run_ids))} if run_ids else {}
    holders = [SlotHolder(run_id, runs.get(run_id), tuple(sorted(holding[run_id])),
                          tuple(sorted(waiting[run_id] - holding[run_id]))) for run_id in run_ids]
    return PoolSlots({pool: info.limit for pool, info in infos.items()}, holders)


def free_stale_slots(instance: DagsterInstance, run_ids: Iterable[str] = ()) -> list[str]:
    """Frees the pool slots and pending claims of every run that is no longer alive (`SlotHolder.alive`
    is False), and of the runs in `run_ids` unless their process is known to run here. A run still marked
    in progress is first marked FAILED (CANCELED if it was canceling), so that the UI agrees it is over.
    Pending claims matter too: a dead run's waiting step would otherwise be assigned the next free slot.
    Returns the freed run ids."""
    forced = set(run_ids)
    freed = []
    for holder in pool_slots(instance).holders:
        if holder.alive is False or (holder.run_id in forced and holder.alive is None):
            run = holder.run
            if run is not None and not run.is_finished:
                reason = (f"its process (pid {holder.pid} on {holder.host}) is gone" if holder.alive is False
                          else "`covlab slots free --run` named it")
                message = (f"covlab marked this run ended: {reason}, and it still held concurrency-pool slots "
                           "(now freed).")
                if run.status == DagsterRunStatus.CANCELING:
                    instance.report_run_canceled(run, message)
                else:
                    instance.report_run_failed(run, message)
            instance.event_log_storage.free_concurrency_slots_for_run(holder.run_id)
            log.info("freed the pool slots of %s", holder.describe())
            freed.append(holder.run_id)
    return freed


# Statuses of a run that has not ended; a run whose process is gone stays in one of them for good.
IN_PROGRESS = (DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED,
               DagsterRunStatus.CANCELING)


def end_dead_runs(instance: DagsterInstance) -> list[str]:
    """Marks FAILED (CANCELED if it was canceling) every run launched from this host by the covlab CLI
    (`launch_tags`) that is still in progress although its process is gone: killed during any step, not only
    one holding a pool slot (those `free_stale_slots` frees). Returns their run ids."""
    host = socket.gethostname()
    ended = []
    for record in instance.get_run_records(RunsFilter(statuses=list(IN_PROGRESS), tags={RUN_HOST_TAG: host})):
        run = record.dagster_run
        pid = run.tags.get(RUN_PID_TAG, "")
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        message = f"covlab marked this run ended: its process (pid {pid} on {host}) is gone."
        if run.status == DagsterRunStatus.CANCELING:
            instance.report_run_canceled(run, message)
        else:
            instance.report_run_failed(run, message)
        log.info("marked run %s ended: its process (pid %s on %s) is gone", run.run_id, pid, host)
        ended.append(run.run_id)
    return ended


def log_pool_holders(instance: DagsterInstance) -> None:
    """Says which runs hold each pool's slots, before a run whose steps in that pool would wait for them."""
    slots = pool_slots(instance)
    for pool, limit in slots.limits.items():
        holders = slots.holding(pool)
        if holders:
            held = sum(p == pool for h in holders for p, _ in h.holding)
            full = limit is not None and held >= limit
            log.info("pool %r: %d of %s slot(s) held by %s%s", pool, held, limit,
                     "; ".join(h.describe() for h in holders),
                     "; steps in this pool wait until one is released" if full else "")
            for holder in holders:
                if holder.alive is None:
                    log.warning(_unknown_holder_advice(holder))


def _unknown_holder_advice(holder: SlotHolder) -> str:
    return (f"covlab cannot tell whether run {holder.run_id} is alive (launched outside the covlab CLI or on "
            f"another host); if it is not running any more, free its slots with "
            f"`covlab slots free --run {holder.run_id}`")


def _check_waits(instance: DagsterInstance, warned: set) -> None:
    """If a step of a run in this process waits for a pool: frees the slots of dead holders, and warns once
    per (step, holders) naming the pool, the runs holding it and what to do."""
    slots = pool_slots(instance)
    if not any(h.waiting and h.in_this_process for h in slots.holders):
        return
    if any(h.alive is False for h in slots.holders):
        free_stale_slots(instance)
        slots = pool_slots(instance)
    for waiter in slots.holders:
        if not waiter.in_this_process:
            continue
        for pool, step in waiter.waiting:
            holders = slots.holding(pool)
            key = (waiter.run_id, step, tuple(h.run_id for h in holders))
            if key in warned or not holders:
                continue
            warned.add(key)
            log.warning("step %s of run %s waits for pool %r (limit %s), held by %s. It starts when that run "
                        "ends. `covlab slots list` shows every holder; `covlab slots free` frees the slots of "
                        "runs that are gone.", step, waiter.run_id, pool, slots.limits.get(pool),
                        "; ".join(h.describe() for h in holders))
            for holder in holders:
                if holder.alive is None:
                    log.warning(_unknown_holder_advice(holder))


@contextmanager
def pool_slots_guard(instance: DagsterInstance,
                     check_every: float = WAIT_CHECK_SECONDS) -> Iterator[dict[str, str]]:
    """Around one in-process launch: frees stale slots and says who holds the pools, yields the run tags of
    this process (`launch_tags`), and while the run executes checks every `check_every` seconds whether one
    of its steps waits for a pool (`_check_waits`). Runs of this host whose process died are marked ended
    (`end_dead_runs`)."""
    free_stale_slots(instance)
    end_dead_runs(instance)
    log_pool_holders(instance)
    stop = threading.Event()

    def watch() -> None:
        warned: set = set()
        while not stop.wait(check_every):
            try:
                _check_waits(instance, warned)
            except Exception as exc:  # a busy SQLite file must not end the run being watched
                log.warning("could not check the pool slots: %s", exc)

    watcher = threading.Thread(target=watch, name="covlab-pool-watch", daemon=True)
    watcher.start()
    try:
        yield launch_tags()
    finally:
        stop.set()
        watcher.join()


def log_to_console() -> None:
    """Shows this module's INFO lines on stderr beside the run's console lines (orchestration/console.py),
    in their layout (once per process)."""
    from covlab.orchestration.console import SourceFormatter

    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(SourceFormatter("covlab"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
