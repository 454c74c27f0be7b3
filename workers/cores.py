"""Each run's share of this host's cores, for a worker that runs several jobs at once.

A Celery worker started with `--concurrency N` runs up to N jobs (or selection groups) at once,
one per pool process. Each run is told its share of the cores this worker may use (its CPU
budget: the CPUs it may run on, or fewer under a container's CPU quota), as
`SHARDYARD_TRAINER_CORES` in its environment (workers/sandbox.py), and keeps its torch threads to
it (trainer/priority.py `use_cores`). The worker learns N before its pool processes are forked
(`set_tasks`, at Celery's worker_init), so every pool process knows it. Outside a worker (a
benchmark, `python -m trainer` by hand) no share is given and a run keeps torch's default. The
Slurm node agent gives its run the CPUs Slurm allocated it on the node (`set_share`), which the
host's other jobs do not use. `SHARDYARD_TRAINER_CORES` sets the share instead (an operator's
choice; on a Slurm node it can only lower the allocation's).

A job's share follows the runs the worker holds (`Seat`): a job that runs alone on a worker with
`--concurrency 4` gets every core, and when a second run starts beside it, both get half. The
worker keeps a board, one slot per pool process (billiard's index of it, which a process that
replaces a dead one takes over), in memory shared with the pool processes and made before they
are forked. A run's pool process writes its pid in its own slot while the trainer runs, so no
lock is needed: each slot has one writer. A job's share is the cores over the runs seated now;
its pool process writes it to a file in the run's folder whenever it changes
(`SHARDYARD_TRAINER_CORES_FILE`), and the trainer takes it between steps (trainer/priority.py
`CoreShare`): a run that starts beside another has the other give up its threads within about
1.5 s and a step. A selection batch's devices are forked processes that split their threads once,
so a batch keeps the share a run gets when the worker is full (the cores over --concurrency); it
sits on the board all the same, so the jobs beside it make room.

The board is one worker's: several workers on one host each count their own runs, and a job alone
on each takes every core. Give such workers `SHARDYARD_TRAINER_CORES`, or run one worker with the
sum of their concurrency. A worker whose pool is not prefork (threads, solo) has no pool process
index: its runs keep the share of a full worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any

from core.safe_files import write_fresh
from core.settings import Settings

log = logging.getLogger(__name__)

_TASKS: list[int] = []
_CORES: list[int] = []
_FIXED: list[int] = []
_BOARD: list[Any] = []
"""[the board]: per pool process index, the pid of that pool process while a run of it sits there
(0: none), in shared memory that the pool processes forked after `set_tasks` inherit."""

CORES_FILE_ENV = "SHARDYARD_TRAINER_CORES_FILE"
"""Where a trainer reads the cores its run is given now (trainer/priority.py CoreShare)."""


def set_tasks(tasks: int, *, cores: int | None = None) -> None:
    """This worker runs up to `tasks` runs at once (its --concurrency), on `cores` (its CPU
    budget; default: the CPUs this process may run on). Call before the pool processes are
    forked: they share the board made here."""
    _TASKS[:] = [max(1, int(tasks))]
    _CORES[:] = [max(1, int(cores))] if cores else []
    _BOARD[:] = [multiprocessing.get_context("fork").RawArray("q", _TASKS[0])]


def set_share(cores: int) -> None:
    """Each run of this process gets `cores` (the Slurm node agent: the CPUs of its allocation on
    its node, core/slurm.py's `srun --cpus-per-task`)."""
    _FIXED[:] = [max(1, int(cores))]


def run_share(settings: Settings) -> int | None:
    """The cores one run of this worker may use when the worker is full: the share this process
    was given (`set_share`, a Slurm allocation), no more than SHARDYARD_TRAINER_CORES where that
    is set too; else that setting; else the cores over the runs it holds at once; or None where
    no worker said how many that is."""
    if _FIXED:
        return min(_FIXED[0], settings.trainer_cores or _FIXED[0])
    if settings.trainer_cores:
        return settings.trainer_cores
    if not _TASKS:
        return None
    return max(1, _cores() // _TASKS[0])


def _cores() -> int:
    return _CORES[0] if _CORES else len(os.sched_getaffinity(0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pool_index() -> int | None:
    """This pool process's slot on the board: billiard's index of it (None outside a prefork
    pool process, or past the board)."""
    if not _BOARD:
        return None
    from billiard.process import current_process

    index = getattr(current_process(), "index", None)
    return index if isinstance(index, int) and 0 <= index < len(_BOARD[0]) else None


def clear_slot() -> None:
    """A new pool process (at Celery's worker_process_init) empties its slot: the process it
    replaces may have died with a run seated there, and its pid may be reused."""
    if (index := pool_index()) is not None:
        _BOARD[0][index] = 0


def seated() -> int:
    """How many runs sit on this worker's board now (a slot whose pool process died is free)."""
    if not _BOARD:
        return 0
    return sum(1 for pid in list(_BOARD[0]) if pid and _alive(pid))


def follows_board(settings: Settings) -> bool:
    """Whether a run's share changes with the runs beside it: on a worker that holds several at
    once, unless the share is fixed (a Slurm allocation's, or SHARDYARD_TRAINER_CORES)."""
    return bool(_BOARD and _TASKS) and _TASKS[0] > 1 and not _FIXED and not settings.trainer_cores


class Seat:
    """One run's place on its worker's board, from its trainer's start to its end, and the share
    of the cores it is given now (written to `path`, in the run's folder, when it changes).
    `slot`: the board's slot (default: this pool process's index; None: the run sits nowhere)."""

    def __init__(self, settings: Settings, path: Path, *, follows: bool, slot: int | None = -1) -> None:
        self.path = path
        self.slot = pool_index() if slot == -1 else slot
        self.follows = follows and follows_board(settings) and self.slot is not None
        self.written: int | None = None
        if self.slot is not None and _BOARD:
            _BOARD[0][self.slot] = os.getpid()

    def share(self) -> int:
        """This run's cores now: the worker's over the runs seated (this one counted)."""
        return max(1, _cores() // max(1, seated()))

    def environment(self) -> dict[str, str]:
        """What the trainer is started with: its share now, and where it finds the next one."""
        if not self.follows:
            return {}
        self.update()
        return {"SHARDYARD_TRAINER_CORES": str(self.written), CORES_FILE_ENV: str(self.path)}

    def update(self) -> None:
        """Write the share again where it changed (the stop poll's pace, every 0.5 s). The file
        is replaced, never written through: the trainer's folder is the trainer's."""
        if not self.follows:
            return
        share = self.share()
        if share != self.written:
            try:
                write_fresh(self.path, f"{share}\n", root=self.path.parent)
            except OSError as e:  # a full disk, a folder the trainer replaced: it keeps its share
                log.warning("the run's share of the cores was not written to %s: %s", self.path, e)
            self.written = share

    def leave(self) -> None:
        if self.slot is not None and _BOARD and _BOARD[0][self.slot] == os.getpid():
            _BOARD[0][self.slot] = 0
