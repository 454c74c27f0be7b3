"""The incremental scheduler's memory of the queue: the queued jobs as wants, kept between ticks
in their order's lanes, with the wait reason each one has in the database.

A tick (core/scheduler.py Scheduler._tick) reads every queued job's version from an index
(db/scheduling.py queued_versions: it changes whenever a job leaves the queue and comes back) and
reads again only the jobs it does not hold at that version; new leaders, and every FULL_S, read
everything. The decision then walks the same order and the same per-job code as `plan`
(core/scheduler.py Planner), lazily: it stops at the first job of lower effective priority than
the blocked job, because from there on no job is placed and each one's reason depends only on its
user and its ask (quota, too big for the fleet, or "behind higher-priority job N"), so the rest of
the queue is given its reasons a kind of job at a time, by set operations, never ordered.
tests/unit/test_queue_cache.py checks it decides as `plan` does on a full read, tick by tick.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from core.scheduler import (
    NO_WORKER,
    Decision,
    Planner,
    State,
    Want,
    effective_priority,
    fair_bucket,
    job_wants,
)
from db import scheduling as dbs

Kind = tuple[int | None, int, int, int, str]
"""(user, ranks, GPUs, host memory, queue): every job of one kind past the blocker waits for the
same reason."""


def lazy_order(
    lanes: Sequence[Sequence[Want]],
    *,
    now: float,
    aging_s: float,
    running_slots: dict[int | None, int],
    recent: dict[int | None, tuple[int, float]],
) -> Iterator[Want]:
    """order_queue's order (fair share), one effective priority at a time and only as far as the
    caller reads. `lanes`: wants of one base priority each, oldest first (so each lane's effective
    priorities never rise along it)."""
    running = dict(running_slots)
    heads = [0] * len(lanes)
    while True:
        best: int | None = None
        for lane, i in zip(lanes, heads, strict=True):
            if i < len(lane):
                w = lane[i]
                w.eff = effective_priority(w.priority, now - w.created, aging_s)
                best = w.eff if best is None else max(best, w.eff)
        if best is None:
            return
        per_user: dict[int | None, list[Want]] = {}
        for k, lane in enumerate(lanes):
            i = heads[k]
            while i < len(lane):
                w = lane[i]
                w.eff = effective_priority(w.priority, now - w.created, aging_s)
                if w.eff != best:
                    break
                per_user.setdefault(w.user, []).append(w)
                i += 1
            heads[k] = i
        yield from fair_bucket(per_user, running, recent)


def _attempts(version: str) -> int:
    """The attempts a version (dbs.queued_versions: "enqueued_at/attempts") names."""
    return int(version.rsplit("/", 1)[1])


class QueueCache:
    """The queued jobs between ticks; `refresh` brings it up to the database, `decide` plans."""

    FULL_S = 60.0
    """Everything is read again at least this often: a bound on how long a change the versions do
    not show (another process rewriting a waiting job's reason) can go unseen."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.version: dict[int, str] = {}
        self.wants: dict[int, Want] = {}
        self.reason: dict[int, str | None] = {}
        self.by_reason: dict[str | None, set[int]] = {}
        self.kinds: dict[Kind, set[int]] = {}
        # per base priority: (created, id) keys oldest first, and the wants in that order
        self.lanes: dict[int, tuple[list[tuple[float, int]], list[Want]]] = {}
        self.loaded_at = float("-inf")
        self.ids = 0
        self.squares = 0
        self.attempts = 0
        """Sums over the jobs held, to compare with the database's (dbs.queued_fingerprint)."""
        self._groups: list[Want] = []
        self._read: dict[int, str | None] = {}
        self._tail: list[tuple[set[int], str]] = []

    # ---- keeping up with the database ----------------------------------------------------------

    def refresh(self, session: Any, needs: Any, *, full: bool = False) -> int:
        """Read what changed since the last tick (everything when `full`, when FULL_S has passed,
        or when the cache is empty); returns the number of jobs read."""
        if full or time.monotonic() - self.loaded_at > self.FULL_S:
            self.clear()
            self.loaded_at = time.monotonic()
        if self.version and dbs.queued_fingerprint(session) == (
            len(self.version),
            self.ids,
            self.squares,
            self.attempts,
        ):
            return 0
        current = dbs.queued_versions(session)
        if current == self.version:
            return 0
        stale = [j for j, v in self.version.items() if current.get(j) != v]
        for j in stale:
            self._drop(j)
        fresh = sorted(j for j in current if j not in self.version)
        wants, reasons = job_wants(session, needs, dbs.queued_jobs(session, fresh))
        for w in wants:
            self._add(w, reasons[w.id], current[w.id])
        return len(fresh)

    def _add(self, w: Want, why: str | None, version: str) -> None:
        self.version[w.id] = version
        self.ids += w.id
        self.squares += w.id * w.id
        self.attempts += _attempts(version)
        self.wants[w.id] = w
        self.reason[w.id] = why
        self.by_reason.setdefault(why, set()).add(w.id)
        self.kinds.setdefault((w.user, w.ranks, w.gpus, w.ram, w.queue), set()).add(w.id)
        keys, lane = self.lanes.setdefault(w.priority, ([], []))
        i = bisect.bisect_left(keys, (w.created, w.id))
        keys.insert(i, (w.created, w.id))
        lane.insert(i, w)

    def _drop(self, job_id: int) -> None:
        version = self.version.pop(job_id, None)
        w = self.wants.pop(job_id, None)
        if w is None or version is None:
            return
        self.ids -= job_id
        self.squares -= job_id * job_id
        self.attempts -= _attempts(version)
        self._unreason(job_id)
        kind = (w.user, w.ranks, w.gpus, w.ram, w.queue)
        self.kinds[kind].discard(job_id)
        if not self.kinds[kind]:
            del self.kinds[kind]
        keys, lane = self.lanes[w.priority]
        i = bisect.bisect_left(keys, (w.created, w.id))
        del keys[i], lane[i]

    def _unreason(self, job_id: int) -> None:
        old = self.reason.pop(job_id, None)
        ids = self.by_reason.get(old)
        if ids is not None:
            ids.discard(job_id)
            if not ids:
                del self.by_reason[old]

    def placed(self, job_id: int) -> None:
        """A job this tick reserved: no longer waiting."""
        self._drop(job_id)

    def written(self, changes: dict[str | None, set[int]]) -> None:
        """The reasons a tick has just written. By set operations on the few distinct reasons,
        not job by job: when the blocked job is placed, every job behind it (11,700 here) gets a
        new one, and moving them one at a time cost 15 ms of the tick."""
        for why, ids in changes.items():
            mine = ids & self.wants.keys()
            if not mine:
                continue
            for old in [r for r in self.by_reason if r != why]:
                held = self.by_reason[old]
                if not held.isdisjoint(mine):
                    held -= mine
                    if not held:
                        del self.by_reason[old]
            self.reason.update(dict.fromkeys(mine, why))
            self.by_reason.setdefault(why, set()).update(mine)

    # ---- deciding ----------------------------------------------------------------------------------

    def decide(self, st: State, *, aging_s: float, preemption: bool) -> Decision:
        """`plan`'s decision on the cached jobs and the state's selection groups (`st.wants`). The
        decision's `order` is the part of the order walked; its `reasons` cover every job."""
        groups = sorted(st.wants, key=lambda w: (w.created, w.id))
        lanes: list[Sequence[Want]] = [lane for _, lane in self.lanes.values()]
        for p in sorted({w.priority for w in groups}):
            lanes.append([w for w in groups if w.priority == p])
        d = Decision()
        self._groups, self._read = groups, st.reasons
        if not st.boxes:
            self._rest(d, lambda w: NO_WORKER)
            return d
        planner = Planner(d, st.boxes, st.quotas, st.running, preemption=preemption)
        order = lazy_order(
            lanes, now=st.now, aging_s=aging_s, running_slots=st.running_slots, recent=st.recent
        )
        for w in order:
            b = planner.blocker
            if b is not None and w.eff < b.eff:
                break  # w and every later job: placed by nobody, waiting for a reason of its kind
            d.order.append(w)
            planner.consider(w)
        blocker = planner.blocker

        def past(w: Want) -> str:
            assert blocker is not None  # the walk stops early only behind a blocked job
            return planner.waiting_past(w, blocker)

        self._rest(d, past)
        return d

    def _rest(self, d: Decision, why_past: Callable[[Want], str]) -> None:
        """Reasons for the jobs and groups the walk did not reach (`why_past`: one kind's reason),
        into `d.reasons`, a kind of job at a time."""
        walked = {w.id for w in d.order}
        self._tail = []
        for ids in self.kinds.values():
            rest = ids - walked if walked else set(ids)
            if rest:
                why = why_past(self.wants[next(iter(rest))])
                d.reasons.update(dict.fromkeys(rest, why))
                self._tail.append((rest, why))
        for g in self._groups:
            if g.id not in walked:
                d.reasons[g.id] = why_past(g)

    def changes(self, d: Decision) -> dict[str | None, set[int]]:
        """The reasons of `decide`'s decision that differ from the database's, by reason (a group's
        given to every trial's job), after its placements: a job placed, or whose reservation
        failed, has none in `d.reasons`."""
        changes: dict[str | None, set[int]] = {}
        for w in d.order:
            if not w.members and w.id in d.reasons and d.reasons[w.id] != self.reason.get(w.id):
                changes.setdefault(d.reasons[w.id], set()).add(w.id)
        for rest, why in self._tail:
            if diff := rest - self.by_reason.get(why, set()):
                changes.setdefault(why, set()).update(diff)
        for g in self._groups:
            if g.id in d.reasons and d.reasons[g.id] != self._read.get(g.id):
                changes.setdefault(d.reasons[g.id], set()).update(g.members)
        return changes
