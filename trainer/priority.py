"""A trainer's CPU priority beside the service (`SHARDYARD_TRAINER_NICE`, core/settings.py), and
its share of the host's cores beside the other runs of its worker (`SHARDYARD_TRAINER_CORES`).

Where the API, the scheduler and a worker share a machine with trainers that use every core, the
service must keep answering. A nice value set from outside does not do it: most Linux kernels
share the CPU between sessions (autogroups) before nice values count, and a trainer runs in a
session of its own (the worker starts each with setsid, in the sandbox or not), so ten busy trainers
hold ten shares against the API's one, whatever their threads' nice values. So the trainer lowers
its own priority as the first thing it does: its session's nice value, through
/proc/self/autogroup, and each of its threads' (the threads it starts after inherit it). Lowering one's
priority needs no privilege; a value at or below the current one changes nothing. The kernel takes
one session's change every tenth of a second, so trainers that start together take turns.

It is cooperative, not enforced: a user's code may set its own session back to nice 0 (the kernel
lets any process do that for its own), as it may use every core it is given. The limits that hold
against a hostile job are the sandbox's and the worker's (workers/limits.py).

The cores: a worker that runs several jobs at once gives each run its share of the host's cores
(workers/cores.py), and the run keeps its torch threads to it (`use_cores`), split between the
processes of the run on this host (torchrun's ranks). torch's default, a thread per core in every
run, puts two runs' threads on each core of a worker that runs two at once: each parallel region
then waits for a thread that has no core, and two such jobs on the 2-core dev VM took 3.0x as
long as with a thread each (bench/run_cores.py). A run started without the variable (by hand,
by a benchmark) keeps torch's default.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Mapping
from pathlib import Path

ENV = "SHARDYARD_TRAINER_NICE"
CORES_ENV = "SHARDYARD_TRAINER_CORES"
AUTOGROUP = Path("/proc/self/autogroup")


def yield_cpu(env: Mapping[str, str] = os.environ) -> int:
    """Take the nice value `env` names (0-19; anything else is left alone: the worker's settings
    validated it). Returns the process's nice value after."""
    raw = env.get(ENV, "").strip()
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if not raw.isdigit() or not 0 < int(raw) <= 19:
        return current
    want = int(raw)
    if want > current:
        # every thread already running (importing torch starts one), then this one's, which the
        # threads it starts later inherit
        done: set[str] = set()
        while todo := set(_threads()) - done:  # again: one it reniced may have started another
            for tid in todo:
                try:
                    os.setpriority(os.PRIO_PROCESS, int(tid), want)
                except OSError:
                    pass  # ended meanwhile
            done |= todo
        os.setpriority(os.PRIO_PROCESS, 0, want)  # this one, whatever /proc shows
    # the kernel takes one session's nice value at a time every tenth of a second from a process
    # without CAP_SYS_ADMIN (EAGAIN otherwise): trainers that start together take turns, in a
    # thread of their own so that none waits to start
    threading.Thread(target=_session_nice, args=(want,), daemon=True, name="session-nice").start()
    return max(want, current)


def _threads() -> list[str]:
    try:
        return os.listdir("/proc/self/task")
    except OSError:
        return []  # no /proc: this thread alone


def _session_nice(want: int, *, tries: int = 100) -> bool:
    """Set this session's nice value to `want`; False where there are no autogroups or the kernel
    kept refusing (the threads' nice value is then all there is)."""
    for _ in range(tries):
        try:
            AUTOGROUP.write_text(str(want))
            return True
        except BlockingIOError:  # EAGAIN: another session changed its own within 0.1 s
            time.sleep(random.uniform(0.1, 0.2))
        except OSError:
            return False
    return False


def positive(raw: str | None) -> int | None:
    """`raw` as a whole number >= 1, or None (unset, empty or anything else)."""
    raw = (raw or "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def cores_given(env: Mapping[str, str] = os.environ) -> int | None:
    """The cores this run's worker gives it (a whole number >= 1), or None: not given."""
    return positive(env.get(CORES_ENV))


def omp_capped(threads: int, env: Mapping[str, str] = os.environ) -> int:
    """`threads`, no more than OMP_NUM_THREADS where that is set (the operator's cap, passed on by
    the worker; torchrun sets 1 for its ranks): a job's processes and a batch's devices alike."""
    cap = positive(env.get("OMP_NUM_THREADS"))
    return threads if cap is None else min(threads, cap)


def use_cores(env: Mapping[str, str] = os.environ) -> int | None:
    """Keep this process's torch threads to its share of the cores given to the run: the run's
    cores over its processes on this host (torchrun's LOCAL_WORLD_SIZE), at least one, and no
    more than OMP_NUM_THREADS where that is set (the operator's, passed on by the worker; torchrun
    sets 1 for its ranks). Returns the threads set, or None (no cores given: torch's default)."""
    given = cores_given(env)
    if given is None:
        return None
    threads = omp_capped(max(1, given // (positive(env.get("LOCAL_WORLD_SIZE")) or 1)), env)
    import torch

    torch.set_num_threads(threads)
    return threads


__all__ = ["CORES_ENV", "ENV", "cores_given", "omp_capped", "positive", "use_cores", "yield_cpu"]
