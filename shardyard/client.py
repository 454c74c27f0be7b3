"""The Python SDK: Shardyard's REST API as typed calls.

    from shardyard.client import Client

    with Client() as sy:                       # SHARDYARD_API_URL, SHARDYARD_TOKEN
        job = sy.submit({"name": "tiny", "train": {"steps": 40}})
        for ev in job.follow():                # metrics, logs, status changes until it ends
            ...
        print(job.wait().result)

The client is synchronous and built on httpx; it imports neither torch nor the service's code.
Every refusal is an ApiError (a ShardyardError) carrying the HTTP status and the API's words,
which name the field and the rule; an API that cannot be reached is Unreachable. Streams ride out
dropped connections and API restarts: they reconnect with Last-Event-ID and go on where they were,
so every step is seen once."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from shardyard.errors import ApiError, ShardyardError, Unreachable, raise_for
from shardyard.results import (
    Job,
    JobEvent,
    LeaderboardRow,
    LogEvent,
    LogRecord,
    MetricEvent,
    NoticeEvent,
    Page,
    Selection,
    SelectionEvent,
    StatusEvent,
    Trial,
    TrialEvent,
    Workspace,
)
from shardyard.stream import END, Frame, StreamTimeout, frames
from shardyard.workspace import archive_body

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "SHARDYARD_API_URL"
TOKEN_ENV = "SHARDYARD_TOKEN"
_TRANSIENT = (502, 503, 504)


def _document(spec: Any, what: str) -> dict[str, Any]:
    """A request body from a dict or a pydantic model (jobrules.spec's JobSpec, SelectionCreate):
    only the fields that were set, so the API fills its own defaults."""
    if hasattr(spec, "model_dump"):
        document: dict[str, Any] = spec.model_dump(mode="json", exclude_unset=True)
        return document
    if isinstance(spec, Mapping):
        return dict(spec)
    raise TypeError(f"{what}: a dict or a pydantic model, not {type(spec).__name__}")


class Client:
    """A connection to one Shardyard API. `url` defaults to $SHARDYARD_API_URL (else
    http://127.0.0.1:8000), `token` to $SHARDYARD_TOKEN: the CLI's settings. `patience_s`: how
    long a stream (and the reads around it) keeps trying to get through an outage before it
    gives up."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        patience_s: float = 600.0,
    ) -> None:
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.patience_s = patience_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # ---- HTTP ---------------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, patience_s: float = 0.0, **kwargs: Any) -> Any:
        """The answer's JSON (None for an empty one). With `patience_s`, a refused connection or
        a 502/503/504 (the API restarting, the database locked) is tried again until then."""
        delay, deadline = 0.5, time.monotonic() + patience_s
        while True:
            try:
                resp = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                if time.monotonic() >= deadline:
                    raise self._unreachable(e) from e
            else:
                if resp.status_code not in _TRANSIENT or time.monotonic() >= deadline:
                    raise_for(resp)
                    return resp.json() if resp.content else None
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

    def _unreachable(self, e: httpx.TransportError) -> Unreachable:
        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            return Unreachable(f"cannot reach the API at {self.url}", url=self.url, lost=False)
        return Unreachable(
            f"lost the connection to the API at {self.url}: {e or type(e).__name__}", url=self.url, lost=True
        )

    def _frames(self, path: str, *, deadline: float | None = None, **kwargs: Any) -> Iterator[Any]:
        patience = kwargs.pop("patience_s", None)
        return frames(
            self._http,
            path,
            patience_s=self.patience_s if patience is None else patience,
            deadline=deadline,
            **kwargs,
        )

    # ---- jobs ---------------------------------------------------------------------------------

    def submit(self, spec: Any, *, workspace: str | Path | None = None) -> Job:
        """Submit a JobSpec (a dict, or jobrules.spec's JobSpec). `workspace`: a folder or
        archive to upload first; the job runs with it."""
        body = _document(spec, "spec")
        if workspace is not None:
            body = {**body, "workspace": self.upload_workspace(workspace).ref}
        return Job.from_json(self._send("POST", "/api/jobs", json=body), self)

    def jobs(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        owner: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> Page[Job]:
        """Jobs the caller may see, newest first; `name`: the name contains it (any case)."""
        return self._page("/api/jobs", Job, status=status, name=name, owner=owner, limit=limit, offset=offset)

    list_jobs = jobs

    def get(self, job_id: int, *, patience_s: float = 0.0) -> Job:
        return Job.from_json(self._send("GET", f"/api/jobs/{job_id}", patience_s=patience_s), self)

    def download(
        self, job_id: int, path: str | Path | None = None, *, best: bool = False, format: str = "pt"
    ) -> Path:
        """The job's trained weights (GET /api/jobs/{id}/checkpoint): its newest whole checkpoint,
        or with `best` the one at its best metric step (a trial's batch metric, a job's val_loss);
        `format="safetensors"` the model's weights alone (`safetensors.torch.load_file` reads them,
        `model.load_state_dict` takes them). Written to `path` (a file, or a folder for the API's
        name job-<id>-step-<n>.pt or .safetensors; default: that name here). Returns the file's
        path; a .pt `torch.load(path, weights_only=True)` reads (its "model" holds the tensors).
        The file appears whole or not at all. ApiError (404, the reason) when the job has none."""
        params = {"best": "true" if best else "false", "format": format}
        return self._download(f"/api/jobs/{job_id}/checkpoint", params, path, what=f"job {job_id}")

    def download_selection(
        self, selection_id: int, path: str | Path | None = None, *, best: bool = False, format: str = "pt"
    ) -> Path:
        """The batch's best trial's weights (GET /api/selections/{id}/checkpoint: the leaderboard's
        first trial), as `download` writes a job's; `best` its checkpoint at its best metric step."""
        params = {"best": "true" if best else "false", "format": format}
        where = f"/api/selections/{selection_id}/checkpoint"
        return self._download(where, params, path, what=f"selection {selection_id}")

    def _download(self, url: str, params: dict[str, str], path: str | Path | None, *, what: str) -> Path:
        with self._http.stream("GET", url, params=params) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise_for(resp)
            disposition = resp.headers.get("content-disposition", "")
            name = disposition.split('filename="', 1)[-1].rstrip('"') if "filename=" in disposition else ""
            name = Path(name).name or f"{what.replace(' ', '-')}.{params['format']}"
            dest = Path(path) if path is not None else Path(name)
            if dest.is_dir():
                dest = dest / name
            tmp = dest.with_name(f".{dest.name}.part")
            try:
                with tmp.open("wb") as fh:
                    for block in resp.iter_bytes(1 << 20):
                        fh.write(block)
                expected = resp.headers.get("content-length")
                if expected is not None and tmp.stat().st_size != int(expected):
                    raise ShardyardError(
                        f"{what}'s checkpoint came short: {tmp.stat().st_size} of {expected} bytes"
                    )
                tmp.replace(dest)
            except httpx.TransportError as e:
                raise self._unreachable(e) from e
            finally:
                tmp.unlink(missing_ok=True)
        return dest

    def cancel(self, job_id: int) -> Job:
        """Ask a queued or running job to stop (a running trainer stops at its next step)."""
        return Job.from_json(self._send("POST", f"/api/jobs/{job_id}/cancel"), self)

    def fail(self, job_id: int, reason: str = "") -> Job:
        """(operator) End a queued or running job `failed`."""
        return Job.from_json(self._send("POST", f"/api/jobs/{job_id}/fail", json={"reason": reason}), self)

    def requeue(self, job_id: int, reason: str = "") -> Job:
        """(operator) Put a running or ended job back in the queue; it resumes from its checkpoint."""
        body = {"reason": reason}
        return Job.from_json(self._send("POST", f"/api/jobs/{job_id}/requeue", json=body), self)

    def logs(self, job_id: int, *, limit: int = 10_000) -> list[LogRecord]:
        """The job's stored log: status lines, the trainer's output, its events."""
        page = self._send("GET", f"/api/jobs/{job_id}/logs", params={"limit": limit})
        return [
            LogRecord(id=e["id"], time=e["time"], kind=e["kind"], message=e["message"], data=e.get("data"))
            for e in page["items"]
        ]

    def follow(
        self,
        job_id: int,
        *,
        patience_s: float | None = None,
        on_interrupt: Callable[[str], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> Iterator[JobEvent]:
        """The job's events from its start (its stored history first, then live) until it ends
        and the API closes the stream: MetricEvent, LogEvent, StatusEvent, NoticeEvent; the
        terminal StatusEvent is always the last event, after every point. A dropped stream
        (the API or the broker restarted) is picked up again with Last-Event-ID, so each point
        comes exactly once; `on_interrupt(reason)` and `on_resume()` are told (default: the
        `shardyard` logger), and after `patience_s` (the client's) without getting through,
        ShardyardError."""
        return self._job_events(job_id, patience_s=patience_s, on_interrupt=on_interrupt, on_resume=on_resume)

    def _job_events(self, job_id: int, **kwargs: Any) -> Iterator[JobEvent]:
        def event(f: Frame) -> JobEvent | None:
            d = f.data
            if f.event == "metric":
                return MetricEvent(
                    job_id=job_id, step=d["step"], name=d["name"], value=d["value"], time=d["time"], id=f.id
                )
            if f.event == "log":
                return LogEvent(
                    job_id=job_id,
                    message=d["message"],
                    time=d["time"],
                    rank=d.get("rank"),
                    stream=d.get("stream"),
                    id=f.id,
                )
            if f.event == "status":
                return StatusEvent(
                    status=d["status"], job_id=job_id, error=d.get("error"), time=d.get("time"), id=f.id
                )
            if f.event == "event":
                return NoticeEvent(
                    job_id=job_id, event=d["event"], data=d.get("data"), time=d["time"], id=f.id
                )
            return None

        return self._until_end(f"/api/jobs/{job_id}/stream", event, **kwargs)

    def _until_end(self, path: str, event: Callable[[Frame], Any], **kwargs: Any) -> Iterator[Any]:
        """`event(frame)` of each frame of the stream at `path` (None: skipped) until the server
        closes it after a terminal StatusEvent, which is yielded last. The server can send the
        terminal status before the last points (a finished job's replay sends its rows a chunk at
        a time, an ended batch's stream sends its status before its points), so the status is held
        until the stream's end; a stream resumed after the end sends the final status again, which
        is not yielded twice. A status after a terminal one (a job requeued) lets the held one go
        first, in the order they came."""
        final: StatusEvent | None = None
        for f in self._frames(path, **kwargs):
            if f.event == END:
                if final is not None:
                    yield final
                    return
                continue
            ev = event(f)
            if ev is None:
                continue
            if isinstance(ev, StatusEvent):
                if final is not None and ev.status == final.status:
                    continue
                if final is not None:
                    yield final
                    final = None
                if ev.done:
                    final = ev
                    continue
            yield ev

    def wait(self, job_id: int, *, timeout: float | None = None) -> Job:
        """The job once it has ended (succeeded, failed or cancelled), read after its stream said
        so; StreamTimeout (a TimeoutError) after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.get(job_id, patience_s=self.patience_s)
        if job.done:
            return job
        try:
            for _ in self._job_events(job_id, deadline=deadline):
                pass
        except StreamTimeout as e:
            raise StreamTimeout(f"job {job_id} has not ended after {timeout:g}s") from e
        return self.get(job_id, patience_s=self.patience_s)

    # ---- selections ---------------------------------------------------------------------------

    def submit_selection(self, request: Any) -> Selection:
        """Submit a selection batch (a dict, or jobrules.spec's SelectionCreate): a base JobSpec,
        a search space, the method, early stopping (README, "Selection batches")."""
        body = _document(request, "request")
        return Selection.from_json(self._send("POST", "/api/selections", json=body), self)

    def selections(
        self,
        *,
        status: str | None = None,
        name: str | None = None,
        owner: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> Page[Selection]:
        """Batches the caller may see, newest first; `name`: the name contains it (any case)."""
        return self._page(
            "/api/selections", Selection, status=status, name=name, owner=owner, limit=limit, offset=offset
        )

    def _page(self, path: str, cls: Any, *, limit: int, offset: int, **filters: str | None) -> Page[Any]:
        """One page of a listing route, its items made `cls` (the filters that are set only)."""
        params: dict[str, Any] = {"limit": limit, "offset": offset, **{k: v for k, v in filters.items() if v}}
        page = self._send("GET", path, params=params)
        return Page([cls.from_json(x, self) for x in page["items"]], page["total"])

    def get_selection(self, selection_id: int, *, patience_s: float = 0.0) -> Selection:
        data = self._send("GET", f"/api/selections/{selection_id}", patience_s=patience_s)
        return Selection.from_json(data, self)

    def selection_trials(self, selection_id: int) -> list[Trial]:
        return self.get_selection(selection_id).trials

    def leaderboard(self, selection_id: int) -> list[LeaderboardRow]:
        """The trials with a metric, best first (by the batch's `metric` and `mode`)."""
        return self.get_selection(selection_id).leaderboard

    def cancel_selection(self, selection_id: int) -> Selection:
        """Cancel the batch: its queued trials at once, its running ones at their next step."""
        return Selection.from_json(self._send("POST", f"/api/selections/{selection_id}/cancel"), self)

    def add_trials(
        self,
        selection_id: int,
        *,
        params: list[dict[str, Any]] | None = None,
        trials: int | None = None,
        warm_start_from: int | None = None,
    ) -> Selection:
        """Grow a grid or random batch: these points of its space, or `trials` more samples."""
        body = {"params": params, "trials": trials, "warm_start_from": warm_start_from}
        body = {k: v for k, v in body.items() if v is not None}
        data = self._send("POST", f"/api/selections/{selection_id}/trials", json=body)
        return Selection.from_json(data, self)

    def follow_selection(
        self,
        selection_id: int,
        *,
        patience_s: float | None = None,
        on_interrupt: Callable[[str], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> Iterator[SelectionEvent]:
        """The batch's events until it ends and the API closes the stream: every trial's state
        first (TrialEvent), the batch's StatusEvent while it runs, then each trial's metric points
        (MetricEvent, with trial_id) and trial changes live, and last the terminal StatusEvent
        (for a batch that had ended already too, after all its points). Reconnects like
        `follow`: after a drop,
        the trials' states come again and then exactly the points not yet seen."""
        return self._selection_events(
            selection_id, patience_s=patience_s, on_interrupt=on_interrupt, on_resume=on_resume
        )

    def _selection_events(self, selection_id: int, **kwargs: Any) -> Iterator[SelectionEvent]:
        def event(f: Frame) -> SelectionEvent | None:
            d = f.data
            if f.event == "metric":
                return MetricEvent(
                    job_id=d["job_id"],
                    trial_id=d["trial_id"],
                    step=d["step"],
                    name=d["name"],
                    value=d["value"],
                    time=d["time"],
                    id=f.id,
                )
            if f.event == "trial":
                return TrialEvent(selection_id=selection_id, trial=Trial.from_json(d))
            if f.event == "status":
                return StatusEvent(status=d["status"], selection_id=selection_id, id=f.id)
            return None

        return self._until_end(f"/api/selections/{selection_id}/stream", event, **kwargs)

    def wait_selection(self, selection_id: int, *, timeout: float | None = None) -> Selection:
        """The batch once it has ended; StreamTimeout after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for _ in self._selection_events(selection_id, deadline=deadline):
                pass
        except StreamTimeout as e:
            raise StreamTimeout(f"selection {selection_id} has not ended after {timeout:g}s") from e
        return self.get_selection(selection_id, patience_s=self.patience_s)

    # ---- workspaces ---------------------------------------------------------------------------

    def upload_workspace(self, path: str | Path, *, name: str | None = None) -> Workspace:
        """Upload a folder (packed into a .tar.gz, caches and VCS folders left out) or an archive
        (.tar.gz, .zip, or a .tar, gzipped here). A JobSpec names the result by its `ref`."""
        path = Path(path)
        body, content_type = archive_body(path)
        data = self._send(
            "POST",
            "/api/workspaces",
            params={"name": name or path.resolve().name or "workspace"},
            content=body,
            headers={"content-type": content_type},
            timeout=300,
        )
        return Workspace.from_json(data)

    def workspaces(self, *, limit: int = 50, offset: int = 0) -> Page[Workspace]:
        page = self._send("GET", "/api/workspaces", params={"limit": limit, "offset": offset})
        return Page([Workspace.from_json(w) for w in page["items"]], page["total"])


__all__ = ["ApiError", "Client", "ShardyardError", "StreamTimeout", "Unreachable"]
