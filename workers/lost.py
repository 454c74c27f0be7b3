"""Why the process running an attempt was lost, in words, recorded for whoever takes its lease back.

A pool process that dies (kill -9, the OOM killer) or an attempt that ends on a full data disk
leaves its job `running` under a lease nobody renews. Whoever takes the lease back (the reconciler,
or the claim of the message Celery gives back: db/jobs.py take_back) explains the restart with the
cause recorded here (db/jobs.py record_lost), or else with what the worker's heartbeat says. The
worker's main process sees a pool process die (workers/tasks.py LostAwareRequest); the pool
process itself sees a full disk.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
from pathlib import Path

from core.settings import Settings
from db.connection import session_for
from db.jobs import record_lost

log = logging.getLogger(__name__)

DISK_FULL = "the data disk was full"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def owner_prefix(pid: int) -> str:
    """What every lease owner id of pool process `pid` on this host starts with (workers/attempt.py
    owner_id: host:pid:random)."""
    return f"{socket.gethostname()}:{pid}:"


def zombie_status(pid: int) -> int | None:
    """The wait status of child `pid` once it has died and before its parent reaps it (a zombie:
    state Z in /proc/<pid>/stat, its exit_code field), else None. Read, not reaped: billiard
    still reaps its pool processes itself."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 50 or fields[0] != "Z":
        return None
    return int(fields[49])  # field 52 of proc(5), counted from the state (field 3)


def death_cause(status: int) -> str:
    """The cause of a pool process's end from its wait status."""
    if os.WIFSIGNALED(status):
        return f"the worker process running it was killed (signal {os.WTERMSIG(status)})"
    return f"the worker process running it exited with code {os.WEXITSTATUS(status)}"


def process_death(status: str) -> str:
    """The cause of a pool process's end from billiard's words for it ("signal 9 (SIGKILL)",
    "exitcode 1")."""
    if m := re.search(r"signal (\d+)", status):
        return f"the worker process running it was killed (signal {m[1]})"
    if m := re.search(r"exitcode (-?\d+)", status):
        return f"the worker process running it exited with code {m[1]}"
    return f"the worker process running it ended ({status})"


def disk_full(e: BaseException | str | None) -> str | None:
    """The cause when `e` (an exception, with its chain, or a relay's broken message) says the
    disk was full: ENOSPC / EDQUOT, or SQLite's "database or disk is full"."""
    if e is None:
        return None
    if isinstance(e, str):
        full = "database or disk is full" in e or os.strerror(errno.ENOSPC) in e
        return f"{DISK_FULL} ({e})" if full else None
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if (isinstance(cur, OSError) and cur.errno in _FULL_ERRNOS) or "database or disk is full" in str(cur):
            return f"{DISK_FULL} ({type(cur).__name__}: {str(cur)[:300]})"
        cur = cur.__cause__ or cur.__context__
    return None


def record(settings: Settings, *, worker: str | None, owner: str, cause: str) -> list[int]:
    """`cause` beside every attempt of `worker` (None: any) whose lease owner starts with `owner`
    (owner_prefix(pid): every lease of a pool process). Best effort: the database may be on the
    disk that is full (the reason then falls back to the heartbeat's)."""
    try:
        with session_for(settings.database_url) as s:
            jobs = record_lost(s, worker=worker, owner_prefix=owner, cause=cause)
    except Exception as e:  # noqa: BLE001 - the lease still runs out; only the reason is poorer
        log.warning("could not record why the attempts of %s were lost (%s): %s", owner, cause, e)
        return []
    if jobs:
        log.warning("job(s) %s: %s", ", ".join(map(str, jobs)), cause)
    return jobs
