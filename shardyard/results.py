"""What the SDK returns: jobs, selection batches and their trials, workspaces, and the events of a
followed stream, as typed dataclasses read from the API's JSON (`raw` keeps the whole answer).

A Job or Selection that came from a Client keeps it, so `job.follow()`, `job.wait()` and
`job.cancel()` work on the object itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
"""The statuses a job or a batch ends in."""

T = TypeVar("T")


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


@dataclass(kw_only=True, slots=True)
class Progress:
    step: int
    """The last step reported (0 before the first)."""
    steps: int
    """The steps the job was asked for."""
    loss: float | None = None


@dataclass(kw_only=True, slots=True)
class Job:
    id: int
    name: str
    status: str
    """queued, running, succeeded, failed or cancelled."""
    kind: str
    queue: str
    priority: int
    world_size: int
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    worker: str | None
    error: str | None
    """Why it failed, in the trainer's or the worker's words."""
    result: dict[str, Any] | None
    """The trainer's summary once it succeeded (final_loss, steps, ...)."""
    spec: dict[str, Any]
    progress: Progress
    cancel_requested: bool
    selection_id: int | None
    owner: str | None
    wait_reason: str | None
    """While queued: why it waits (the scheduler's words)."""
    run_seconds: float
    restarts: int
    divergence: str | None = None
    """Why the run counts as diverged (its final smoothed loss far above its first), or None."""
    stopped_early: bool = False
    """A trial's job that early stopping cut short (its status is still `succeeded`)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The API's JSON as it came."""
    _client: _Client | None = field(default=None, repr=False, compare=False)

    @property
    def diverged(self) -> bool:
        return self.divergence is not None

    @classmethod
    def from_json(cls, d: dict[str, Any], client: _Client | None = None) -> Job:
        p = d.get("progress") or {}
        return cls(
            id=d["id"],
            name=d["name"],
            status=d["status"],
            kind=d.get("kind", "job"),
            queue=d.get("queue", ""),
            priority=d.get("priority", 0),
            world_size=d.get("world_size", 1),
            attempts=d.get("attempts", 0),
            created_at=_when(d["created_at"]),  # type: ignore[arg-type]
            started_at=_when(d.get("started_at")),
            finished_at=_when(d.get("finished_at")),
            worker=d.get("worker"),
            error=d.get("error"),
            result=d.get("result"),
            spec=d.get("spec") or {},
            progress=Progress(step=p.get("step", 0), steps=p.get("steps", 0), loss=p.get("loss")),
            cancel_requested=d.get("cancel_requested", False),
            selection_id=d.get("selection_id"),
            owner=d.get("owner"),
            wait_reason=d.get("wait_reason"),
            run_seconds=float(d.get("run_seconds") or 0.0),
            restarts=d.get("restarts", 0),
            divergence=d.get("divergence"),
            stopped_early=bool(d.get("stopped_early")),
            raw=d,
            _client=client,
        )

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def _c(self) -> _Client:
        if self._client is None:
            raise RuntimeError(f"job {self.id} was not read through a Client")
        return self._client

    def refresh(self) -> Job:
        """The job as the API has it now (a new object)."""
        return self._c().get(self.id)

    def follow(self, **kwargs: Any) -> Iterator[JobEvent]:
        """Client.follow(self.id): its metrics, logs and status changes until it ends."""
        return self._c().follow(self.id, **kwargs)

    def wait(self, timeout: float | None = None) -> Job:
        """Client.wait(self.id): the job once it has ended."""
        return self._c().wait(self.id, timeout=timeout)

    def cancel(self) -> Job:
        return self._c().cancel(self.id)

    def download(self, path: str | Path | None = None, *, best: bool = False, format: str = "pt") -> Path:
        """Client.download(self.id, path, best=, format=): the job's newest (or best) whole
        checkpoint, or its weights as safetensors, as a file."""
        return self._c().download(self.id, path, best=best, format=format)


@dataclass(kw_only=True, slots=True)
class Trial:
    """One variant of a selection batch; it runs as the job `job_id`."""

    id: int
    index: int
    params: dict[str, Any]
    """The point of the search space this trial trains (`{"train.lr": 0.003}`)."""
    status: str
    steps_done: int
    steps_total: int
    last_metric: float | None
    best_metric: float | None
    stopped_early: bool
    job_id: int
    warm_start_from: int | None
    result: dict[str, Any] | None
    stop_reason: Any
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trial:
        return cls(
            id=d["id"],
            index=d["index"],
            params=d.get("params") or {},
            status=d["status"],
            steps_done=d.get("steps_done", 0),
            steps_total=d.get("steps_total", 0),
            last_metric=d.get("last_metric"),
            best_metric=d.get("best_metric"),
            stopped_early=d.get("stopped_early", False),
            job_id=d["job_id"],
            warm_start_from=d.get("warm_start_from"),
            result=d.get("result"),
            stop_reason=d.get("stop_reason"),
            raw=d,
        )


@dataclass(kw_only=True, slots=True)
class LeaderboardRow:
    """A trial with a metric, in the batch's order (rank 1 is the best by `metric` and `mode`)."""

    rank: int
    trial: Trial
    metric: str
    best: float | None
    """The trial's best value of `metric`."""


@dataclass(kw_only=True, slots=True)
class Selection:
    """A model-selection batch: many variants of one JobSpec trained side by side."""

    id: int
    name: str
    status: str
    metric: str
    mode: str
    """min or max: which way is better for `metric`."""
    scheduler: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    space: dict[str, Any]
    request: dict[str, Any]
    cancel_requested: bool
    error: str | None
    trials: list[Trial]
    leaderboard_ids: list[int]
    """Trial ids with a metric, best first."""
    owner: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    _client: _Client | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any], client: _Client | None = None) -> Selection:
        return cls(
            id=d["id"],
            name=d["name"],
            status=d["status"],
            metric=d.get("metric", "val_loss"),
            mode=d.get("mode", "min"),
            scheduler=d.get("scheduler", ""),
            created_at=_when(d["created_at"]),  # type: ignore[arg-type]
            started_at=_when(d.get("started_at")),
            finished_at=_when(d.get("finished_at")),
            space=d.get("space") or {},
            request=d.get("request") or {},
            cancel_requested=d.get("cancel_requested", False),
            error=d.get("error"),
            trials=[Trial.from_json(t) for t in d.get("trials") or []],
            leaderboard_ids=list(d.get("leaderboard") or []),
            owner=d.get("owner"),
            raw=d,
            _client=client,
        )

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def leaderboard(self) -> list[LeaderboardRow]:
        by_id = {t.id: t for t in self.trials}
        return [
            LeaderboardRow(rank=i + 1, trial=by_id[tid], metric=self.metric, best=by_id[tid].best_metric)
            for i, tid in enumerate(self.leaderboard_ids)
            if tid in by_id
        ]

    @property
    def best(self) -> Trial | None:
        """The leaderboard's first trial (None until a trial has a metric)."""
        board = self.leaderboard
        return board[0].trial if board else None

    def _c(self) -> _Client:
        if self._client is None:
            raise RuntimeError(f"selection {self.id} was not read through a Client")
        return self._client

    def refresh(self) -> Selection:
        return self._c().get_selection(self.id)

    def follow(self, **kwargs: Any) -> Iterator[SelectionEvent]:
        """Client.follow_selection(self.id): trial changes and metrics until the batch ends."""
        return self._c().follow_selection(self.id, **kwargs)

    def wait(self, timeout: float | None = None) -> Selection:
        return self._c().wait_selection(self.id, timeout=timeout)

    def cancel(self) -> Selection:
        return self._c().cancel_selection(self.id)

    def download(self, path: str | Path | None = None, *, best: bool = False, format: str = "pt") -> Path:
        """Client.download_selection(self.id, ...): the best trial's checkpoint or weights."""
        return self._c().download_selection(self.id, path, best=best, format=format)


@dataclass(kw_only=True, slots=True)
class Workspace:
    """An uploaded archive of code and small data; a JobSpec names it by `ref`."""

    id: int
    ref: str
    """`sha256:<digest>`, what a JobSpec's `workspace` takes."""
    digest: str
    size: int
    name: str
    format: str
    created_at: datetime
    owner_id: int | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Workspace:
        return cls(
            id=d["id"],
            ref=d["ref"],
            digest=d["digest"],
            size=d["size"],
            name=d["name"],
            format=d["format"],
            created_at=_when(d["created_at"]),  # type: ignore[arg-type]
            owner_id=d.get("owner_id"),
        )


@dataclass(kw_only=True, slots=True)
class LogRecord:
    """One row of a job's stored log: a status change, a line of the trainer's output, an event."""

    id: int
    time: float
    kind: str
    message: str
    data: dict[str, Any] | None

    @property
    def rank(self) -> int | None:
        return (self.data or {}).get("rank")


@dataclass(slots=True)
class Page(Generic[T]):
    """One page of a listing and the count of all that matched."""

    items: list[T]
    total: int

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


# ---- events of a followed stream -----------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class MetricEvent:
    """A point of a job's series (`loss`, `val_loss`, `step_time_ms`, ...); in a batch's stream
    `trial_id` says whose."""

    job_id: int
    step: int
    name: str
    value: float
    time: float
    trial_id: int | None = None
    id: str | None = None
    """The stream's resume cursor after this point (what Last-Event-ID carries)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LogEvent:
    """A status line or a line of the trainer's own output (`rank` and `stream` say whose)."""

    job_id: int
    message: str
    time: float
    rank: int | None = None
    stream: str | None = None
    id: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class StatusEvent:
    """A job's (`job_id`) or a batch's (`selection_id`) new status; `error` says why it failed."""

    status: str
    job_id: int | None = None
    selection_id: int | None = None
    error: str | None = None
    time: float | None = None
    id: str | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


@dataclass(kw_only=True, slots=True, frozen=True)
class NoticeEvent:
    """Another event of a job's life (a checkpoint, a restart, the trainer's start info)."""

    job_id: int
    event: str
    data: Any
    time: float
    id: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class TrialEvent:
    """A trial of a batch as it is now (sent on connect, and whenever one changes)."""

    selection_id: int
    trial: Trial


JobEvent = MetricEvent | LogEvent | StatusEvent | NoticeEvent
SelectionEvent = MetricEvent | TrialEvent | StatusEvent


class _Client(Protocol):
    """What a Job or a Selection asks of the Client it came from (shardyard/client.py's Client): a
    protocol, so that this module needs nothing of the client module, which imports it."""

    def get(self, job_id: int, *, patience_s: float = 0.0) -> Job: ...
    def follow(
        self,
        job_id: int,
        *,
        patience_s: float | None = None,
        on_interrupt: Callable[[str], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> Iterator[JobEvent]: ...
    def wait(self, job_id: int, *, timeout: float | None = None) -> Job: ...
    def cancel(self, job_id: int) -> Job: ...
    def download(
        self, job_id: int, path: str | Path | None = None, *, best: bool = False, format: str = "pt"
    ) -> Path: ...
    def download_selection(
        self, selection_id: int, path: str | Path | None = None, *, best: bool = False, format: str = "pt"
    ) -> Path: ...
    def get_selection(self, selection_id: int, *, patience_s: float = 0.0) -> Selection: ...
    def follow_selection(
        self,
        selection_id: int,
        *,
        patience_s: float | None = None,
        on_interrupt: Callable[[str], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> Iterator[SelectionEvent]: ...
    def wait_selection(self, selection_id: int, *, timeout: float | None = None) -> Selection: ...
    def cancel_selection(self, selection_id: int) -> Selection: ...
