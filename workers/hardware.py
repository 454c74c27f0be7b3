"""Samples what a trainer does to its host and device: per rank, the CPU % of the rank's process
with every thread and every process below it (a selection batch's CPU devices are processes its
executor forks: the executor alone idles while they train) and the rank's resident memory (from
/proc), and where NVML answers (`nvidia-ml-py`, a GPU node), the GPU's utilisation,
the memory the rank holds on it and the board's power. The samples become metric lines of the
job (`hw.<what>.r<rank>`), so they land through the relay exactly like the loss: stored once per
(name, step), streamed live, charted beside it.

A rank is a process of the trainer's process group (its session: workers/supervise.py starts it in
one) that torchrun gave a RANK; a single-process trainer is rank 0. Nothing here may harm a run: a
sample that fails is skipped, NVML missing or without a driver turns GPU sampling off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PROC = Path("/proc")


@dataclass(slots=True)
class Group:
    """What one read of /proc says of a trainer's process group: its ranks and every process's
    children (of the whole machine: a child that left the group is still the rank's)."""

    ranks: dict[int, int]
    """{rank: pid}: torchrun's workers by their RANK, else the trainer as rank 0."""
    children: dict[int, list[int]]

    def tree(self, pid: int) -> list[int]:
        """`pid` and every process below it: a rank's own processes (a selection batch's CPU
        devices are processes forked by its executor, a data loader's workers too)."""
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += self.children.get(p, [])
        return out


def read_group(pgid: int) -> Group:
    """The ranks of session/group `pgid` and the machine's process tree, in one pass over /proc.
    A single-process trainer is rank 0: the group's leader, or, in a sandbox, the first process
    below bubblewrap's own (workers/sandbox.py: the leader is bwrap)."""
    ranks: dict[int, int] = {}
    members: dict[int, tuple[int, str]] = {}  # pid -> (parent pid, command name), of the group
    children: dict[int, list[int]] = {}
    for d in _PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            # the command name may hold spaces and parentheses: the fields start after the last ')'
            fields = stat[stat.rindex(")") + 2 :].split()
            children.setdefault(int(fields[1]), []).append(int(d.name))
            if int(fields[2]) != pgid:
                continue
            members[int(d.name)] = (int(fields[1]), stat[stat.index("(") + 1 : stat.rindex(")")])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=") and e[5:].isdigit()), None)
        if rank is not None:
            ranks[rank] = int(d.name)
    return Group(ranks=ranks or {0: _trainer_of(pgid, members)}, children=children)


def group_ranks(pgid: int) -> dict[int, int]:
    """{rank: pid} for the processes of session/group `pgid` (read_group)."""
    return read_group(pgid).ranks


def _trainer_of(pgid: int, members: dict[int, tuple[int, str]]) -> int:
    """The single-process trainer of group `pgid`: its leader, unless that is bubblewrap, whose
    first child that is not bubblewrap is the trainer."""
    sandbox = {pid for pid, (_, name) in members.items() if name == "bwrap"}
    if pgid not in sandbox:
        return pgid
    below = sorted(pid for pid, (parent, name) in members.items() if parent in sandbox and pid not in sandbox)
    return below[0] if below else pgid


def _cpu_ticks(pid: int) -> int:
    """CPU time of process `pid` (every thread of it) and of its children it has waited for
    (utime + stime + cutime + cstime): a child that ended keeps counting through its parent."""
    fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])


def tree_ticks(group: Group, pid: int) -> int:
    """CPU time of `pid` and every process below it, as _cpu_ticks counts it. Raises OSError when
    `pid` itself is gone; a descendant that ends meanwhile is skipped."""
    total = _cpu_ticks(pid)
    for p in group.tree(pid)[1:]:
        try:
            total += _cpu_ticks(p)
        except (OSError, ValueError, IndexError):
            continue
    return total


def _rss_mb(pid: int) -> float:
    return int((_PROC / str(pid) / "statm").read_text().split()[1]) * _PAGE / 2**20


class _Nvml:
    """The GPU side; `ok` False (and nothing called) where nvidia-ml-py or a driver is missing."""

    def __init__(self) -> None:
        self.ok = False
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self.nv: Any = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.ok = bool(self.handles)
        except Exception as e:  # noqa: BLE001 - no library, no driver, no device: CPU samples only
            log.debug("NVML unavailable: %s", e)

    def sample(self, pids: dict[int, int]) -> dict[int, dict[str, float]]:
        """{rank: {gpu_util, gpu_mem_mb, gpu_power_w}} for the ranks found on a device."""
        by_pid = {pid: rank for rank, pid in pids.items()}
        out: dict[int, dict[str, float]] = {}
        for h in self.handles:
            try:
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h)
                mine = [(by_pid[p.pid], p) for p in procs if p.pid in by_pid]
                if not mine:
                    continue
                util = float(self.nv.nvmlDeviceGetUtilizationRates(h).gpu)
                power = self.nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                for rank, p in mine:
                    out[rank] = {
                        "gpu_util": util,
                        "gpu_mem_mb": (p.usedGpuMemory or 0) / 2**20,
                        "gpu_power_w": power,
                    }
            except Exception as e:  # noqa: BLE001 - one device's sample lost, not the run
                log.debug("NVML sample failed: %s", e)
        return out


@dataclass(slots=True)
class _Last:
    ticks: int
    at: float


class HardwareSampler:
    """A thread that samples process group `pgid` every `every_s` seconds and hands each value to
    `emit(name, value)` until `stop`."""

    def __init__(self, pgid: int, *, emit: Callable[[str, float], None], every_s: float) -> None:
        self.pgid, self.emit, self.every_s = pgid, emit, every_s
        self._last: dict[int, _Last] = {}
        self._done = threading.Event()
        self._nvml: _Nvml | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="hw-sampler")

    def start(self) -> HardwareSampler:
        if self.every_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def sample(self) -> dict[str, float]:
        """One sample of every rank: {metric name: value}. CPU % (of the rank's whole process
        tree, so above 100 with several busy cores) needs a previous sample of the same process,
        so a rank's first sample has its memory only."""
        values: dict[str, float] = {}
        group = read_group(self.pgid)
        pids = group.ranks
        now = time.monotonic()
        for rank, pid in sorted(pids.items()):
            try:
                ticks, rss = tree_ticks(group, pid), _rss_mb(pid)
            except (OSError, ValueError, IndexError):
                continue  # the rank just ended
            values[f"hw.rss_mb.r{rank}"] = round(rss, 1)
            last = self._last.get(pid)
            if last is not None and now > last.at:
                # a descendant that ended unreaped takes its time with it: never below zero
                used = max(0, ticks - last.ticks)
                values[f"hw.cpu_pct.r{rank}"] = round(100.0 * used / _TICK / (now - last.at), 1)
            self._last[pid] = _Last(ticks=ticks, at=now)
        if self._nvml is None:
            self._nvml = _Nvml()
        if self._nvml.ok:
            for rank, got in self._nvml.sample(pids).items():
                for what, v in got.items():
                    values[f"hw.{what}.r{rank}"] = round(v, 1)
        return values

    def _run(self) -> None:
        self.sample()  # the baseline of each rank's CPU time
        while not self._done.wait(self.every_s):
            try:
                for name, value in self.sample().items():
                    self.emit(name, value)
            except Exception:  # noqa: BLE001 - a sample is never worth a run
                log.exception("hardware sample failed")
