"""`shardyard`'s user commands: submit and watch jobs and selection batches, a client of the REST
API like any other (its calls go through the SDK, shardyard/client.py). The server's own commands
(`serve`, `worker`, `stack`, ...) join these in api/cli.py, the `shardyard` console script.

    shardyard submit spec.json [--follow] [--workspace DIR]     shardyard jobs [--status running]
    shardyard show ID    shardyard cancel ID    shardyard logs ID    shardyard follow ID
    shardyard download ID [--best] [--safetensors] [--selection]
    shardyard selection submit FILE|- [--follow]    shardyard selection show ID [--json]
    shardyard selection list [--status running] [--name NAME] [--json]
    shardyard selection follow ID    shardyard selection cancel ID

The API address comes from --api or SHARDYARD_API_URL (default http://127.0.0.1:8000), the API
token from --token or SHARDYARD_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from shardyard.client import Client
from shardyard.errors import ShardyardError, Unreachable
from shardyard.results import Job, LogEvent, MetricEvent, Page, Selection, StatusEvent, Trial, TrialEvent

console = Console()
err = Console(stderr=True)
SELECTION_EXIT = {"succeeded": 0, "failed": 1, "cancelled": 3}
"""`shardyard selection follow`'s exit code by how the batch ended (2 stays the CLI's error)."""

_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def shown(value: object) -> str:
    """Text from the server (names, errors, log lines) as rich prints it literally: markup
    (`[/]`, `[bold]`) escaped, control characters and direction overrides written as escapes
    (a terminal must not obey them)."""
    text = _CONTROLS.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), str(value))
    return escape(text)


class CliError(Exception):
    pass


def _client(args: argparse.Namespace) -> Client:
    return Client(args.api, args.token)


def _say_interrupted(reason: str) -> None:
    err.print(f"[yellow]stream interrupted ({shown(reason)}); reconnecting...[/]")


def _say_resumed() -> None:
    err.print("[green]stream resumed[/]")


def pace(*, step0: int, t0: float, step: int, now: float, steps: int) -> tuple[float | None, float | None]:
    """(steps/s, seconds left) from the steps seen since (`step0`, `t0`); None until two points."""
    if step <= step0 or now <= t0:
        return None, None
    rate = (step - step0) / (now - t0)
    return rate, max(0.0, (steps - step) / rate)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _log_text(ev: LogEvent) -> str:
    return (escape(f"[rank {ev.rank}] ") if ev.rank is not None else "") + shown(ev.message)


RATE_WINDOW_S = 30.0
"""steps/s is the pace over the last this many seconds of the job's own clock (its points' times)."""


@dataclass
class FollowView:
    """What `shardyard follow` shows of a job, from the job as it was when the view attached (its
    status, the current attempt's start, the seconds its attempts have run) and the events that
    follow. The stream replays the job's history first: its old status changes (queued, running)
    must not become the status or restart the clock, and its points, arriving in a burst, must
    not make the pace (20,000 steps/s): the pace comes from the points' own times."""

    status: str
    steps: int
    since: float | None
    """The current attempt's start (unix time, the server's clock); None when it never ran."""
    run_s: float
    """Seconds the job's attempts had run up to `mark` (the job's run_seconds at attach)."""
    mark: float | None
    """time.monotonic() when the clock last started (None while queued or ended: it stands)."""
    points: deque[tuple[int, float]] = field(default_factory=deque)
    step: int = 0

    @classmethod
    def attach(cls, job: Any, *, now: float) -> FollowView:
        since = job.started_at.timestamp() if job.started_at is not None else None
        running = job.status == "running"
        return cls(
            status=job.status,
            steps=job.progress.steps or 1,
            since=since,
            run_s=job.run_seconds or 0.0,
            mark=now if running else None,
            step=job.progress.step or 0,
        )

    def history(self, ev: StatusEvent) -> bool:
        """A replayed status change from before the current attempt started: a `queued` before its
        start, any other a second or more before it (the attempt's own `running` is written at its
        start, by the worker's clock rather than the database's)."""
        if ev.time is None or self.since is None:
            return False
        return ev.time < self.since - (0.0 if ev.status == "queued" else 1.0)

    def on_status(self, ev: StatusEvent, *, now: float) -> bool:
        """Take a status event; True when the job went back to the queue (its wait is news)."""
        if self.history(ev) or ev.status == self.status:
            return False
        back = ev.status == "queued" and self.status != "queued"
        if self.mark is not None:  # the clock stands while queued or ended
            self.run_s += now - self.mark
            self.mark = None
        if ev.status == "running":
            self.mark = now
            self.points.clear()  # a new attempt: its pace is its own
        self.status = ev.status
        return back

    def on_loss(self, step: int, at: float) -> None:
        """A loss point at `step`, recorded at `at` (unix time, the job's clock)."""
        if self.points and step < self.points[-1][0]:
            self.points.clear()  # resumed from an earlier checkpoint
        self.points.append((step, at))
        while len(self.points) > 2 and self.points[0][1] < at - RATE_WINDOW_S:
            self.points.popleft()
        self.step = step

    def pace(self) -> tuple[float | None, float | None]:
        """(steps/s over the last RATE_WINDOW_S of points, seconds left at it)."""
        if len(self.points) < 2:
            return None, None
        (step0, t0), (step, t) = self.points[0], self.points[-1]
        return pace(step0=step0, t0=t0, step=step, now=t, steps=self.steps)

    def elapsed(self, now: float) -> float:
        """Seconds the job has run: its attempts before, and this one so far."""
        return self.run_s + (now - self.mark if self.mark is not None else 0.0)


def follow(client: Client, job_id: int) -> str:
    # the reads around the stream ride out an API restart like the stream does
    job = client.get(job_id, patience_s=client.patience_s)
    view = FollowView.attach(job, now=time.monotonic())
    if view.status == "queued" and job.wait_reason:
        err.print(f"[yellow]queued:[/] {shown(job.wait_reason)}")
    with Progress(
        TextColumn("[bold]job {task.fields[job]}[/] {task.fields[status]}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}  val {task.fields[val]}"),
        TextColumn("{task.fields[rate]} steps/s  elapsed {task.fields[elapsed]}  ETA {task.fields[eta]}"),
        console=console,
    ) as bar:
        task = bar.add_task(
            "train",
            total=view.steps,
            completed=view.step,
            job=job_id,
            status=view.status,
            loss="-",
            val="-",
            rate="-",
            elapsed=clock(view.elapsed(time.monotonic())) if job.run_seconds else "-",
            eta="-",
        )
        for ev in client.follow(job_id, on_interrupt=_say_interrupted, on_resume=_say_resumed):
            if isinstance(ev, MetricEvent):
                if ev.name == "loss":
                    view.on_loss(ev.step, ev.time)
                    rate, left = view.pace()
                    bar.update(
                        task,
                        completed=ev.step,
                        loss=f"{ev.value:.4f}",
                        rate=f"{rate:.2f}" if rate else "-",
                        elapsed=clock(view.elapsed(time.monotonic())),
                        eta=clock(left) if view.status == "running" else "-",
                    )
                elif ev.name == "val_loss":
                    bar.update(task, val=f"{ev.value:.4f}")
            elif isinstance(ev, StatusEvent):
                back = view.on_status(ev, now=time.monotonic())
                bar.update(task, status=view.status, elapsed=clock(view.elapsed(time.monotonic())))
                if back:  # requeued or preempted: say why it waits now (the first reason is printed above)
                    why = client.get(job_id, patience_s=client.patience_s).wait_reason
                    if why:
                        bar.console.print(f"[yellow]queued:[/] {shown(why)}")
                if ev.done and ev.error:
                    err.print(f"[red]error:[/] {shown(ev.error)}")
            elif isinstance(ev, LogEvent):
                bar.console.print(f"[dim]{_log_text(ev)}[/]", highlight=False)
    final = client.get(job_id, patience_s=client.patience_s)
    if final.result:
        console.print_json(data=final.result)
    for note in job_notes(final):
        err.print(f"[yellow]{note}[/]", highlight=False)
    return final.status


def job_notes(job: Job) -> list[str]:
    """What a job's status alone does not say: its trial was stopped early (and why), its run
    diverged."""
    notes = []
    if job.stopped_early:
        why = job.raw.get("stop_reason") or {}
        detail = (
            f" at the rung of step {why['rung']}: {why['value']:.4g}, no better than the cutoff "
            f"{why['cutoff']:.4g} ({why['kept']} of {why['of']} trials went on)"
            if {"rung", "value", "cutoff", "kept", "of"} <= why.keys()
            else ""
        )
        notes.append(f"stopped early{detail}")
    if job.divergence:
        notes.append(shown(job.divergence))
    return notes


def _read_json(source: str, what: str) -> dict[str, Any]:
    """A JSON object from a file, or from stdin when `source` is `-`."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as e:
        raise CliError(f"cannot read {source}: {e.strerror}") from e
    name = "stdin" if source == "-" else source
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise CliError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CliError(f"{name}: a {what} is a JSON object, not {type(doc).__name__}")
    return doc


def cmd_submit(args: argparse.Namespace) -> int:
    spec = _read_json(args.spec, "JobSpec")
    with _client(args) as c:
        if args.workspace is not None:
            ws = c.upload_workspace(Path(args.workspace))
            console.print(f"uploaded workspace [bold]{ws.id}[/] ({ws.ref[:19]}..., {ws.size:,} bytes)")
            spec = {**spec, "workspace": ws.ref}
        job = c.submit(spec)
        console.print(f"submitted job [bold]{job.id}[/] ({shown(job.name)}), status {job.status}")
        if args.follow:
            return 0 if follow(c, job.id) == "succeeded" else 1
    return 0


def _print_page(table: Table, page: Page[Any], noun: str) -> int:
    """A listing's table and how many of all that matched it shows; the command's exit code."""
    console.print(table)
    console.print(f"{len(page)} of {page.total} {noun}(s)")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        page = c.jobs(status=args.status, limit=args.limit)
    table = Table("id", "name", "status", "progress", "worker", "created", "duration", "error")
    for j in page:
        table.add_row(
            str(j.id),
            shown(j.name),
            j.status + (" (diverged)" if j.diverged else ""),
            f"{j.progress.step}/{j.progress.steps}",
            shown(j.worker or ""),
            j.raw["created_at"][:19],
            clock(j.run_seconds) if j.started_at else "-",
            shown((j.error or "")[:60]),
        )
    return _print_page(table, page, "job")


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.id)
    # the notes on stderr: stdout stays the job's JSON for scripts
    for note in job_notes(job):
        err.print(f"job {job.id} ({job.status}): [yellow]{note}[/]", highlight=False)
    console.print_json(data=job.raw)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.cancel(args.id)
    note = " (the trainer stops at its next step)" if job.status == "running" else ""
    console.print(f"job {job.id}: {job.status}, cancel requested{note}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    fmt = "safetensors" if args.safetensors else "pt"
    with _client(args) as c:
        if args.selection:
            path = c.download_selection(args.id, args.output, best=args.best, format=fmt)
            what = f"selection {args.id}'s best trial"
        else:
            path = c.download(args.id, args.output, best=args.best, format=fmt)
            what = f"job {args.id}"
    console.print(f"{what}: wrote {shown(str(path))} ({path.stat().st_size:,} bytes)")
    return 0


def cmd_fail(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.fail(args.id, args.reason)
    console.print(f"job {job.id}: {job.status} ({shown(job.error)})")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.requeue(args.id, args.reason)
    console.print(f"job {job.id}: {job.status}, resumes from its latest checkpoint")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    def show(kind: str, message: str, at: float, rank: int | None) -> None:
        if args.rank is not None and rank != args.rank:
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(at))
        prefix = "status " if kind == "status" else f"[rank {rank}] " if rank is not None else ""
        console.print(f"[dim]{stamp}[/] {escape(prefix)}{shown(message)}", highlight=False)

    with _client(args) as c:
        if args.follow:
            # the stream replays the job's log from its start, then follows it until the job ends
            for ev in c.follow(args.id, on_interrupt=_say_interrupted, on_resume=_say_resumed):
                if isinstance(ev, LogEvent):
                    show("log", ev.message, ev.time, ev.rank)
                elif isinstance(ev, StatusEvent):
                    show("status", ev.status, ev.time or time.time(), None)
            return 0
        for rec in c.logs(args.id, limit=10_000):
            show(rec.kind, rec.message, rec.time, rec.rank)
    return 0


def cmd_follow(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return 0 if follow(c, args.id) == "succeeded" else 1


# ---- selection batches ----------------------------------------------------------------------------


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _value(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _print_selection(sel: Selection) -> None:
    """The batch's head line, its trials and its leaderboard as tables."""
    done = sum(t.status not in ("queued", "running") for t in sel.trials)
    console.print(
        f"selection [bold]{sel.id}[/] ({shown(sel.name)}): {sel.status}, {done}/{len(sel.trials)} "
        f"trial(s) ended; {shown(sel.metric)} ({sel.mode}), scheduler {shown(sel.scheduler)}",
        highlight=False,
    )
    if sel.error:
        err.print(f"[yellow]note:[/] {shown(sel.error)}")
    trials = Table(
        "trial", "params", "status", "steps", f"last {shown(sel.metric)}", "best", "job", title="trials"
    )
    for t in sorted(sel.trials, key=lambda t: t.index):
        trials.add_row(
            str(t.index),
            shown(_params_text(t.params)),
            t.status + (" (early)" if t.stopped_early and t.status != "stopped_early" else ""),
            f"{t.steps_done}/{t.steps_total}",
            _value(t.last_metric),
            _value(t.best_metric),
            str(t.job_id),
        )
    console.print(trials)
    board = Table(
        "rank", "trial", "params", f"best {shown(sel.metric)}", "status", "job", title="leaderboard"
    )
    for row in sel.leaderboard:
        board.add_row(
            str(row.rank),
            str(row.trial.index),
            shown(_params_text(row.trial.params)),
            _value(row.best),
            row.trial.status,
            str(row.trial.job_id),
        )
    if sel.leaderboard:
        console.print(board)
        console.print(
            f"the best trial's weights: shardyard download {sel.leaderboard[0].trial.job_id} "
            f"(or shardyard download --selection {sel.id} [--safetensors])"
        )
    else:
        console.print("leaderboard: no trial has a metric yet")


def follow_selection(client: Client, selection_id: int) -> str:
    """The batch live until it ends: a line per trial that changes status, a bar of the steps
    done over all trials; the trials and leaderboard at the end. Returns the batch's status."""
    sel = client.get_selection(selection_id, patience_s=client.patience_s)
    trials: dict[int, Trial] = {t.id: t for t in sel.trials}
    steps: dict[int, int] = {t.id: t.steps_done for t in sel.trials}
    status = sel.status
    best: float | None = None
    better = min if sel.mode == "min" else max
    with Progress(
        TextColumn("[bold]selection {task.fields[sel]}[/] {task.fields[status]}"),
        BarColumn(),
        TextColumn("steps {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("trials ended {task.fields[ended]}  best {task.fields[metric]} {task.fields[best]}"),
        console=console,
    ) as bar:

        def ended() -> str:
            return f"{sum(t.status not in ('queued', 'running') for t in trials.values())}/{len(trials)}"

        task = bar.add_task(
            "batch",
            total=sum(t.steps_total for t in trials.values()) or 1,
            completed=sum(steps.values()),
            sel=selection_id,
            status=status,
            ended=ended(),
            metric=shown(sel.metric),
            best="-",
        )
        for ev in client.follow_selection(
            selection_id, on_interrupt=_say_interrupted, on_resume=_say_resumed
        ):
            if isinstance(ev, TrialEvent):
                t, was = ev.trial, trials.get(ev.trial.id)
                trials[t.id] = t
                steps[t.id] = max(steps.get(t.id, 0), t.steps_done)
                if was is not None and was.status != t.status:
                    why = (
                        f": best {shown(sel.metric)} {_value(t.best_metric)}"
                        if t.best_metric is not None
                        else ""
                    )
                    bar.console.print(
                        f"trial {t.index} ({shown(_params_text(t.params))}) {t.status} at step {t.steps_done}{why}",
                        highlight=False,
                    )
            elif isinstance(ev, MetricEvent) and ev.trial_id is not None:
                steps[ev.trial_id] = max(steps.get(ev.trial_id, 0), ev.step)
                if ev.name == sel.metric:
                    best = ev.value if best is None else better(best, ev.value)
            elif isinstance(ev, StatusEvent):
                status = ev.status
            bar.update(
                task,
                total=sum(t.steps_total for t in trials.values()) or 1,
                completed=sum(steps.values()),
                status=status,
                ended=ended(),
                best=_value(best),
            )
    final = client.get_selection(selection_id, patience_s=client.patience_s)
    _print_selection(final)
    return final.status


def cmd_selection_submit(args: argparse.Namespace) -> int:
    body = _read_json(args.file, "selection request")
    with _client(args) as c:
        sel = c.submit_selection(body)
        console.print(
            f"submitted selection [bold]{sel.id}[/] ({shown(sel.name)}): {len(sel.trials)} trial(s), "
            f"status {sel.status}",
            highlight=False,
        )
        if args.follow:
            return SELECTION_EXIT.get(follow_selection(c, sel.id), 1)
    return 0


def cmd_selection_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        page = c.selections(status=args.status, name=args.name, owner=args.owner, limit=args.limit)
    if args.json:
        console.print_json(data={"items": [s.raw for s in page], "total": page.total})
        return 0
    table = Table(
        "id", "name", "status", "trials", "method", "metric", "best", "best trial", "owner", "created"
    )
    for s in page:
        ended = sum(t.status not in ("queued", "running") for t in s.trials)
        best = s.best
        table.add_row(
            str(s.id),
            shown(s.name),
            s.status,
            f"{ended}/{len(s.trials)}",
            shown(s.request.get("method", "")),
            f"{shown(s.metric)} ({s.mode})",
            _value(best.best_metric) if best else "-",
            shown(_params_text(best.params)) if best else "-",
            shown(s.owner or ""),
            s.raw["created_at"][:19],
        )
    return _print_page(table, page, "selection")


def cmd_selection_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        sel = c.get_selection(args.id)
    if args.json:
        console.print_json(data=sel.raw)
    else:
        _print_selection(sel)
    return 0


def cmd_selection_follow(args: argparse.Namespace) -> int:
    with _client(args) as c:
        return SELECTION_EXIT.get(follow_selection(c, args.id), 1)


def cmd_selection_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        sel = c.cancel_selection(args.id)
    running = sum(t.status == "running" for t in sel.trials)
    note = f" ({running} running trial(s) stop at their next step)" if running else ""
    console.print(f"selection {sel.id}: {sel.status}, cancel requested{note}")
    return 0


if TYPE_CHECKING:
    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
    """The `shardyard` subcommands (`add_subparsers()`): the server adds its own to these."""


def build_parser(
    *, description: str | None = None, more: Callable[[Commands], None] | None = None
) -> argparse.ArgumentParser:
    """The user commands; `more` adds others after them (api/cli.py: the server's own)."""
    ap = argparse.ArgumentParser(
        prog="shardyard",
        description=description or __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--api", default=os.environ.get("SHARDYARD_API_URL", "http://127.0.0.1:8000"), help="API base URL"
    )
    ap.add_argument(
        "--token", default=os.environ.get("SHARDYARD_TOKEN"), help="API token (default: $SHARDYARD_TOKEN)"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    _add_job_commands(sub)
    _add_selection_commands(sub)
    if more is not None:
        more(sub)
    return ap


def _add_job_commands(sub: Commands) -> None:
    """`shardyard submit|jobs|show|cancel|follow|download|logs|fail|requeue`."""
    p = sub.add_parser("submit", help="submit a JobSpec JSON file")
    p.add_argument("spec")
    p.add_argument("--follow", "-f", action="store_true", help="show progress and live loss until it ends")
    p.add_argument(
        "--workspace",
        "-w",
        metavar="DIR",
        help="pack and upload DIR (or upload a .tar, .tar.gz or .zip); the job runs with it",
    )
    p.set_defaults(fn=cmd_submit)
    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(fn=cmd_jobs)
    for name, fn, text in [
        ("show", cmd_show, "one job as JSON"),
        ("cancel", cmd_cancel, "cancel a queued or running job"),
        ("follow", cmd_follow, "watch a job until it ends"),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("id", type=int)
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "download",
        help="a job's trained weights: its newest whole checkpoint (torch.load(path, weights_only=True))",
    )
    p.add_argument("id", type=int, help="the job (with --selection: the selection batch)")
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="where to write it (a file or a folder; default: job-<id>-step-<n>.pt here)",
    )
    p.add_argument(
        "--best",
        action="store_true",
        help="the checkpoint at the job's best metric step (a trial's batch metric, a job's val_loss), "
        "not its newest",
    )
    p.add_argument(
        "--safetensors",
        action="store_true",
        help="the model's weights alone as safetensors (job-<id>-step-<n>.safetensors)",
    )
    p.add_argument(
        "--selection",
        action="store_true",
        help="ID is a selection batch: its best trial's (the leaderboard's first)",
    )
    p.set_defaults(fn=cmd_download)
    p = sub.add_parser("logs", help="a job's log: status lines and the trainer's own output")
    p.add_argument("id", type=int)
    p.add_argument("--follow", "-f", action="store_true", help="stream new lines until the job ends")
    p.add_argument("--rank", type=int, help="only this rank's output (status lines left out)")
    p.set_defaults(fn=cmd_logs)
    for name, fn, text in [
        ("fail", cmd_fail, "operator: end a queued or running job `failed`"),
        ("requeue", cmd_requeue, "operator: put a running or ended job back in the queue"),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("id", type=int)
        p.add_argument("--reason", default="", help="kept in the job's log")
        p.set_defaults(fn=fn)


def _add_selection_commands(sub: Commands) -> None:
    """`shardyard selection submit|list|show|follow|cancel`."""
    p = sub.add_parser("selection", help="model-selection batches: submit, list, show, follow, cancel")
    sel = p.add_subparsers(dest="selection_command", required=True)
    p = sel.add_parser("submit", help="submit a selection request (JSON file, or - for stdin)")
    p.add_argument("file", metavar="FILE|-")
    p.add_argument("--follow", "-f", action="store_true", help="follow the batch until it ends")
    p.set_defaults(fn=cmd_selection_submit)
    p = sel.add_parser("list", help="list batches, newest first")
    p.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    p.add_argument("--name", help="only batches whose name contains this (any case)")
    p.add_argument("--owner", help="only this user's batches (admins)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true", help="the API's JSON page instead of a table")
    p.set_defaults(fn=cmd_selection_list)
    p = sel.add_parser("show", help="a batch's trials and leaderboard as tables")
    p.add_argument("id", type=int)
    p.add_argument("--json", action="store_true", help="the API's JSON instead of tables")
    p.set_defaults(fn=cmd_selection_show)
    p = sel.add_parser("follow", help="watch a batch until it ends (exit 0 succeeded, 1 failed, 3 cancelled)")
    p.add_argument("id", type=int)
    p.set_defaults(fn=cmd_selection_follow)
    p = sel.add_parser("cancel", help="cancel a batch: queued trials now, running ones at their next step")
    p.add_argument("id", type=int)
    p.set_defaults(fn=cmd_selection_cancel)


def run(args: argparse.Namespace) -> int:
    """The command `args` chose, its errors said in a line (exit 2)."""
    try:
        code: int = args.fn(args)
    except Unreachable as e:
        if e.lost:
            err.print(f"[red]error:[/] {shown(e)}")
        else:
            err.print(f"[red]error:[/] {shown(e)} (is `shardyard serve` or `make demo` running?)")
        return 2
    except (CliError, ShardyardError) as e:
        err.print(f"[red]error:[/] {shown(e)}")
        return 2
    return code


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
