"""Each run's share of this host's cores, for a worker that runs several jobs at once.

A Celery worker started with `--concurrency N` runs up to N jobs (or selection groups) at once,
one per pool process. Each run is told its share, the cores this worker may use over N (at least
one), as `SHARDYARD_TRAINER_CORES` in its environment (workers/sandbox.py), and keeps its torch
threads to it (trainer/priority.py `use_cores`). The worker learns N before its pool processes
are forked (`set_tasks`, at Celery's worker_init), so every pool process knows it. Outside a
worker (a benchmark, `python -m trainer` by hand) no share is given and a run keeps torch's
default. The Slurm node agent gives its run the CPUs Slurm allocated it on the node (`set_share`),
which the host's other jobs do not use. `SHARDYARD_TRAINER_CORES` sets the share instead (an
operator's choice; on a Slurm node it can only lower the allocation's).

A job's share follows the runs the worker holds (`Seat`): a job that runs alone on a worker with
`--concurrency 4` gets every core, and when a second run starts beside it, both get half. Each
job's run sits on the worker's board (one slot per pool process, in memory shared with the pool
processes, made before they are forked) for as long as its trainer runs; the run's share is the
cores over the runs seated now. The pool process writes it to a file in the run's folder whenever
it changes (`SHARDYARD_TRAINER_CORES_FILE`), and the trainer takes it between steps
(trainer/priority.py `CoreShare`). A selection batch's devices are forked processes that cannot
change their split once made, so a batch keeps the share a run gets when the worker is full (its
cores over --concurrency); it counts on the board all the same, so the jobs beside it make room.
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
_FIXED: list[int] = []
_BOARD: list[Any] = []
"""[the board]: one slot per run the worker may hold, the pid of the pool process whose run sits
there (0: free), in shared memory that the pool processes forked after `set_tasks` inherit."""


def set_tasks(tasks: int) -> None:
    """This worker runs up to `tasks` runs at once (its --concurrency). Call before the pool
    processes are forked: they share the board made here."""
    _TASKS[:] = [max(1, int(tasks))]
    _BOARD[:] = [multiprocessing.get_context("fork").Array("q", _TASKS[0])]


def set_share(cores: int) -> None:
    """Each run of this process gets `cores` (the Slurm node agent: the CPUs of its allocation on
    its node, core/slurm.py's `srun --cpus-per-task`)."""
    _FIXED[:] = [max(1, int(cores))]


def run_share(settings: Settings) -> int | None:
    """The cores one run of this worker may use: the share this process was given (`set_share`,
    a Slurm allocation), no more than SHARDYARD_TRAINER_CORES where that is set too; else that
    setting; else the cores over the runs it holds at once; or None where no worker said how
    many that is."""
    if _FIXED:
        return min(_FIXED[0], settings.trainer_cores or _FIXED[0])
    if settings.trainer_cores:
        return settings.trainer_cores
    if not _TASKS:
        return None
    return max(1, _cores() // _TASKS[0])


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def seated() -> int:
    """How many runs sit on this worker's board now (a slot whose pool process died is free)."""
    if not _BOARD:
        return 0
    board = _BOARD[0]
    with board.get_lock():
        return sum(1 for pid in board if pid and _alive(pid))


class Seat:
    """One run's place on its worker's board, from its trainer's start to its end, and the share
    of the cores it is given now (written to `path`, in the run's folder, when it changes)."""

    def __init__(self, settings: Settings, path: Path, *, follows: bool) -> None:
        self.path = path
        self.follows = follows and follows_board(settings)
        self.written: int | None = None
        self.pid = os.getpid()
        if _BOARD:
            board = _BOARD[0]
            with board.get_lock():
                slots = [i for i, pid in enumerate(board) if pid == self.pid] or [
                    i for i, pid in enumerate(board) if not pid or not _alive(pid)
                ]
                if slots:  # else a run beyond --concurrency (a test calling execute by hand)
                    board[slots[0]] = self.pid

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
        if _BOARD:
            board = _BOARD[0]
            with board.get_lock():
                for i, pid in enumerate(board):
                    if pid == self.pid:
                        board[i] = 0


CORES_FILE_ENV = "SHARDYARD_TRAINER_CORES_FILE"
"""Where a trainer reads the cores its run is given now (trainer/priority.py CoreShare)."""


def follows_board(settings: Settings) -> bool:
    """Whether a run's share changes with the runs beside it: on a worker that holds several at
    once, unless the share is fixed (a Slurm allocation's, or SHARDYARD_TRAINER_CORES)."""
    return bool(_BOARD and _TASKS) and _TASKS[0] > 1 and not _FIXED and not settings.trainer_cores
