"""`shardyard`: submit and watch jobs over the REST API, and run the service's processes.

    shardyard submit spec.json [--follow] [--workspace DIR]     shardyard jobs [--status running]
    shardyard show ID    shardyard cancel ID    shardyard logs ID    shardyard follow ID
    shardyard serve      shardyard worker       shardyard stack [--demo]    shardyard migrate
    shardyard scheduler [--metrics-port 9101]    shardyard healthcheck
    shardyard admin create-user NAME [--admin]

The API address comes from --api or SHARDYARD_API_URL (default http://127.0.0.1:8000), the API
token from --token or SHARDYARD_TOKEN.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

console = Console()
err = Console(stderr=True)
TERMINAL = {"succeeded", "failed", "cancelled"}
DEMO_SPEC = Path(__file__).resolve().parent / "demo_spec.json"


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def shown(value: object) -> str:
    """Text from the server (names, errors, log lines) as rich prints it literally: markup
    (`[/]`, `[bold]`) escaped, control characters and direction overrides written as escapes
    (a terminal must not obey them)."""
    text = _CONTROLS.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), str(value))
    return escape(text)


class CliError(Exception):
    pass


def _client(api: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=api, timeout=30, headers=headers)


def _check(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise CliError(f"{resp.status_code}: {detail}")
    return resp.json()


class _Interrupted(Exception):
    """The stream ended or the server asked us to come back later (503)."""


def sse_events(
    client: httpx.Client, path: str, *, patience_s: float = 600.0
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) pairs from a Server-Sent Events endpoint, for as long as the caller reads.
    A dropped connection (API or broker restarted), a stream that ends, or a 503 is followed by a
    reconnect with Last-Event-ID, so nothing is seen twice or missed; after `patience_s` without
    getting through, CliError."""
    last_id: str | None = None
    delay, down_since = 0.5, None
    while True:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        try:
            with client.stream("GET", path, headers=headers, timeout=httpx.Timeout(30, read=None)) as resp:
                if resp.status_code in (429, 502, 503, 504):
                    resp.read()
                    raise _Interrupted(f"{resp.status_code}: {resp.text[:200]}")
                if resp.status_code >= 400:
                    resp.read()
                    _check(resp)
                fid, event, data = None, "message", []
                for line in resp.iter_lines():
                    if line == "":
                        if data and event == "error":
                            # the server ended the stream for good (the token was revoked)
                            raise CliError(f"stream {path}: {json.loads(chr(10).join(data)).get('detail')}")
                        if data:
                            last_id = fid or last_id
                            if down_since is not None:
                                err.print("[green]stream resumed[/]")
                            delay, down_since = 0.5, None
                            yield event, json.loads("\n".join(data))
                        fid, event, data = None, "message", []
                    elif line.startswith("id:"):
                        fid = line[3:].strip()
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
            raise _Interrupted("the server closed the stream")
        except (httpx.TransportError, _Interrupted) as e:
            now = time.monotonic()
            if down_since is None:
                down_since = now
                err.print(f"[yellow]stream interrupted ({shown(e or type(e).__name__)}); reconnecting...[/]")
            elif now - down_since > patience_s:
                raise CliError(
                    f"lost the stream {path} for {patience_s:.0f}s: {e or type(e).__name__}"
                ) from e
            time.sleep(delay)
            delay = min(2 * delay, 5.0)


def _get_patiently(client: httpx.Client, path: str, *, patience_s: float = 600.0) -> dict[str, Any]:
    """GET that rides out an API restart (connection refused, 503) like the stream does."""
    delay, deadline = 0.5, time.monotonic() + patience_s
    while True:
        try:
            resp = client.get(path)
            if resp.status_code not in (502, 503, 504):
                return _check(resp)
            problem: str = f"{resp.status_code}: {resp.text[:200]}"
        except httpx.TransportError as e:
            problem = str(e) or type(e).__name__
        if time.monotonic() > deadline:
            raise CliError(f"GET {path} did not get through for {patience_s:.0f}s: {problem}")
        time.sleep(delay)
        delay = min(2 * delay, 5.0)


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


def _log_text(data: dict[str, Any]) -> str:
    rank = data.get("rank")
    return (escape(f"[rank {rank}] ") if rank is not None else "") + shown(data["message"])


def follow(client: httpx.Client, job_id: int) -> str:
    job = _get_patiently(client, f"/api/jobs/{job_id}")
    steps = job["progress"]["steps"] or 1
    status = job["status"]
    if status == "queued" and job.get("wait_reason"):
        err.print(f"[yellow]queued:[/] {shown(job['wait_reason'])}")
    first: tuple[int, float] | None = None
    started = time.monotonic() - float(job.get("run_seconds") or 0.0)
    with Progress(
        TextColumn("[bold]job {task.fields[job]}[/] {task.fields[status]}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}  val {task.fields[val]}"),
        TextColumn("{task.fields[rate]} steps/s  elapsed {task.fields[elapsed]}  ETA {task.fields[eta]}"),
        console=console,
    ) as bar:
        task = bar.add_task(
            "train", total=steps, job=job_id, status=status, loss="-", val="-", rate="-", elapsed="-", eta="-"
        )
        for event, data in sse_events(client, f"/api/jobs/{job_id}/stream"):
            if event == "metric":
                if data["name"] == "loss":
                    now = time.monotonic()
                    first = first or (data["step"], now)
                    rate, left = pace(step0=first[0], t0=first[1], step=data["step"], now=now, steps=steps)
                    bar.update(
                        task,
                        completed=data["step"],
                        loss=f"{data['value']:.4f}",
                        rate=f"{rate:.2f}" if rate else "-",
                        elapsed=clock(now - started),
                        eta=clock(left),
                    )
                elif data["name"] == "val_loss":
                    bar.update(task, val=f"{data['value']:.4f}")
            elif event == "status":
                if status == "queued" and data["status"] == "running":
                    started = time.monotonic()
                back = data["status"] == "queued" and status != "queued"
                status = data["status"]
                bar.update(task, status=status)
                if back:  # requeued or preempted: say why it waits now (the first reason is printed above)
                    why = _get_patiently(client, f"/api/jobs/{job_id}").get("wait_reason")
                    if why:
                        bar.console.print(f"[yellow]queued:[/] {shown(why)}")
                if status in TERMINAL:
                    if data.get("error"):
                        err.print(f"[red]error:[/] {shown(data['error'])}")
                    break
            elif event == "log":
                bar.console.print(f"[dim]{_log_text(data)}[/]", highlight=False)
    final = _get_patiently(client, f"/api/jobs/{job_id}")
    if final.get("result"):
        console.print_json(data=final["result"])
    return final["status"]


_SKIP_DIRS = {"__pycache__", ".git", ".venv", "node_modules", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def pack_workspace(folder: Path) -> bytes:
    """`folder` as a .tar.gz whose members are relative to it (caches and VCS folders left out).
    Symlinks are refused here, as the server would refuse them."""
    if not folder.is_dir():
        raise CliError(f"--workspace {folder}: not a folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if _SKIP_DIRS.intersection(rel.parts):
                continue
            if path.is_symlink():
                raise CliError(f"--workspace: {rel} is a symlink; workspaces hold plain files only")
            if path.is_file():
                tar.add(path, arcname=rel.as_posix(), recursive=False)
    return buf.getvalue()


def upload_workspace(c: httpx.Client, folder: Path) -> dict[str, Any]:
    body = pack_workspace(folder)
    return _check(
        c.post(
            "/api/workspaces",
            params={"name": folder.resolve().name or "workspace"},
            content=body,
            headers={"content-type": "application/gzip"},
            timeout=300,
        )
    )


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        spec = json.loads(Path(args.spec).read_text())
    except OSError as e:
        raise CliError(f"cannot read {args.spec}: {e.strerror}") from e
    except ValueError as e:
        raise CliError(f"{args.spec} is not valid JSON: {e}") from e
    with _client(args.api, args.token) as c:
        if args.workspace is not None:
            ws = upload_workspace(c, Path(args.workspace))
            console.print(
                f"uploaded workspace [bold]{ws['id']}[/] ({ws['ref'][:19]}..., {ws['size']:,} bytes)"
            )
            spec = {**spec, "workspace": ws["ref"]}
        job = _check(c.post("/api/jobs", json=spec))
        console.print(f"submitted job [bold]{job['id']}[/] ({shown(job['name'])}), status {job['status']}")
        if args.follow:
            return 0 if follow(c, job["id"]) == "succeeded" else 1
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    params = {"limit": args.limit}
    if args.status:
        params["status"] = args.status
    with _client(args.api, args.token) as c:
        page = _check(c.get("/api/jobs", params=params))
    table = Table("id", "name", "status", "progress", "worker", "created", "duration", "error")
    for j in page["items"]:
        p = j["progress"]
        table.add_row(
            str(j["id"]),
            shown(j["name"]),
            j["status"],
            f"{p['step']}/{p['steps']}",
            shown(j["worker"] or ""),
            j["created_at"][:19],
            clock(j["run_seconds"]) if j.get("started_at") else "-",
            shown((j["error"] or "")[:60]),
        )
    console.print(table)
    console.print(f"{len(page['items'])} of {page['total']} job(s)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args.api, args.token) as c:
        console.print_json(data=_check(c.get(f"/api/jobs/{args.id}")))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args.api, args.token) as c:
        job = _check(c.post(f"/api/jobs/{args.id}/cancel"))
    note = " (the trainer stops at its next step)" if job["status"] == "running" else ""
    console.print(f"job {job['id']}: {job['status']}, cancel requested{note}")
    return 0


def cmd_fail(args: argparse.Namespace) -> int:
    with _client(args.api, args.token) as c:
        job = _check(c.post(f"/api/jobs/{args.id}/fail", json={"reason": args.reason}))
    console.print(f"job {job['id']}: {job['status']} ({shown(job['error'])})")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    with _client(args.api, args.token) as c:
        job = _check(c.post(f"/api/jobs/{args.id}/requeue", json={"reason": args.reason}))
    console.print(f"job {job['id']}: {job['status']}, resumes from its latest checkpoint")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    def show(kind: str, message: str, at: float, rank: int | None) -> None:
        if args.rank is not None and rank != args.rank:
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(at))
        prefix = "status " if kind == "status" else f"[rank {rank}] " if rank is not None else ""
        console.print(f"[dim]{stamp}[/] {escape(prefix)}{shown(message)}", highlight=False)

    with _client(args.api, args.token) as c:
        if args.follow:
            # the stream replays the job's log from its start, then follows it until the job ends
            for event, data in sse_events(c, f"/api/jobs/{args.id}/stream"):
                if event == "log":
                    show("log", data["message"], data["time"], data.get("rank"))
                elif event == "status":
                    show("status", data["status"], data["time"], None)
                    if data["status"] in TERMINAL:
                        break
            return 0
        for ev in _check(c.get(f"/api/jobs/{args.id}/logs", params={"limit": 10_000}))["items"]:
            show(ev["kind"], ev["message"], ev["time"], (ev.get("data") or {}).get("rank"))
    return 0


def cmd_follow(args: argparse.Namespace) -> int:
    with _client(args.api, args.token) as c:
        return 0 if follow(c, args.id) == "succeeded" else 1


def cmd_migrate(_args: argparse.Namespace) -> int:
    from core.settings import get_settings
    from db.migrate import upgrade

    url = get_settings().database_url
    upgrade(url)
    console.print(f"database {url} is at the latest migration")
    return 0


def cmd_admin_create_user(args: argparse.Namespace) -> int:
    """Straight to the database (the way to make the first admin): prints the token once."""
    from api.auth import issue_token
    from core.settings import get_settings
    from db.engine import session_for
    from db.jobs import Conflict
    from db.users import create_user

    if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", args.name):
        raise CliError("name: 1-64 letters, digits or _ . @ -")
    cmd_migrate(args)
    with session_for(get_settings().database_url) as s:
        try:
            user = create_user(s, name=args.name, is_admin=args.admin)
        except Conflict as e:
            raise CliError(str(e)) from e
        secret, _ = issue_token(s, user_id=user.id, label="cli")
    role = "admin" if args.admin else "user"
    err.print(f"created {role} {args.name}; the token is shown this once (export SHARDYARD_TOKEN=...):")
    print(secret)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from core.multiproc import fresh_multiproc_dir
    from core.settings import get_settings

    cmd_migrate(args)
    # the embedded scheduler is a child process: its instruments reach /metrics through this
    # folder (core/telemetry.py); set before anything imports prometheus_client
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        path = fresh_multiproc_dir(get_settings().data_dir / f"prometheus-{args.port}")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    uvicorn.run("api.asgi:app", host=args.host, port=args.port, timeout_graceful_shutdown=3)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from api.stack import worker_command

    cmd_migrate(args)
    cmd = worker_command(queues=args.queues, concurrency=args.concurrency)
    os.execvp(cmd[0], cmd)


def cmd_scheduler(args: argparse.Namespace) -> int:
    """The scheduler on its own (core/scheduler.py): one of these, or the API processes' embedded
    ones, is active at a time (a database lock); set SHARDYARD_EMBEDDED_SCHEDULER=0 on the API
    when this runs instead."""
    import logging
    import signal

    from core.scheduler import Scheduler
    from core.settings import get_settings
    from core.webhooks import Deliverer

    cmd_migrate(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.metrics_port:
        # no API process beside it to serve these: its own /metrics on the given port
        from prometheus_client import REGISTRY, start_http_server

        from core.telemetry import multiprocess, multiprocess_registry

        registry = multiprocess_registry() if multiprocess() else REGISTRY
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    sched = Scheduler(get_settings())
    deliverer = Deliverer(get_settings()).start()
    signal.signal(signal.SIGTERM, lambda *_: sched.stop_event.set())
    try:
        sched.run()
    except KeyboardInterrupt:
        pass
    finally:
        deliverer.stop()
    return 0


def cmd_healthcheck(_args: argparse.Namespace) -> int:
    from api.healthcheck import Unhealthy, healthcheck

    try:
        console.print(healthcheck(), highlight=False)
    except Unhealthy as e:
        raise CliError(f"unhealthy: {e}") from e
    return 0


def _follow_demo(stack: Any, job_id: int) -> None:
    """The demo job's progress, in a thread of its own: the main thread supervises the stack."""
    try:
        with _client(stack.base_url, stack.admin_token) as c:
            follow(c, job_id)
        console.print(f"[bold green]dashboard:[/] {stack.base_url}/#/jobs/{job_id}")
        console.print("the stack keeps running; press Ctrl-C to stop everything")
    except (CliError, httpx.HTTPError) as e:
        err.print(f"[yellow]stopped following job {job_id}: {e}[/]")


def cmd_stack(args: argparse.Namespace) -> int:
    import signal
    import threading

    from api.stack import CrashLoop, Stack
    from core.settings import get_settings

    # SIGTERM (kill, timeout, a service manager) must stop the stack's processes like Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(args.root)
    # the workers' warm shutdown kills trainers that have not checkpointed after the grace;
    # wait that long plus time for the worker to write the jobs back and exit
    shutdown_s = get_settings().shutdown_grace_s + 30
    stack = Stack(root=root, api_port=args.port, workers=args.workers, shutdown_s=shutdown_s)
    console.print(
        f"starting redis-server, the API on {stack.base_url} and {args.workers} worker(s); logs in {root}/"
    )
    try:
        stack.start()
        console.print(f"[bold green]dashboard:[/] {stack.base_url}/")
        console.print(
            f"[bold]admin token[/] (sign in to the dashboard with it; CLI: export SHARDYARD_TOKEN=...):\n"
            f"{stack.admin_token}",
            highlight=False,
        )
        if args.demo:
            with _client(stack.base_url, stack.admin_token) as c:
                spec = json.loads(DEMO_SPEC.read_text())
                job = _check(c.post("/api/jobs", json=spec))
            console.print(
                f"submitted demo job {job['id']} ({spec['name']}): {stack.base_url}/#/jobs/{job['id']}"
            )
            threading.Thread(target=_follow_demo, args=(stack, job["id"]), daemon=True, name="demo").start()
        else:
            console.print("the stack keeps running; press Ctrl-C to stop everything")
        # a process that dies is restarted (with a back-off); only Ctrl-C, SIGTERM or a crash
        # loop end this
        stack.supervise(say=lambda line: err.print(f"[yellow]{line}[/]", highlight=False))
    except CrashLoop as e:
        err.print(f"[red]stopping the stack: {e}[/]", highlight=False)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        console.print(
            f"stopping: running jobs checkpoint and go back to the queue (up to {shutdown_s:.0f}s; "
            "Ctrl-C again to kill them)..."
        )
        stack.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardyard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--api", default=os.environ.get("SHARDYARD_API_URL", "http://127.0.0.1:8000"), help="API base URL"
    )
    ap.add_argument(
        "--token", default=os.environ.get("SHARDYARD_TOKEN"), help="API token (default: $SHARDYARD_TOKEN)"
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="submit a JobSpec JSON file")
    p.add_argument("spec")
    p.add_argument("--follow", "-f", action="store_true", help="show progress and live loss until it ends")
    p.add_argument("--workspace", "-w", metavar="DIR", help="pack and upload DIR; the job runs with it")
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
    p = sub.add_parser("migrate", help="bring the database to the latest migration")
    p.set_defaults(fn=cmd_migrate)
    p = sub.add_parser("serve", help="run the API (migrates first)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("worker", help="run a Celery worker (migrates first)")
    p.add_argument("--queues", default="cpu,gpu")
    p.add_argument("--concurrency", type=int, default=1)
    p.set_defaults(fn=cmd_worker)
    p = sub.add_parser("scheduler", help="run the scheduler standalone (migrates first)")
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve this process's Prometheus metrics on this port"
    )
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.set_defaults(fn=cmd_scheduler)
    p = sub.add_parser("healthcheck", help="exit 0 when this container's API, worker or scheduler is healthy")
    p.set_defaults(fn=cmd_healthcheck)
    p = sub.add_parser("admin", help="administration straight on the database")
    admin = p.add_subparsers(dest="admin_command", required=True)
    p = admin.add_parser("create-user", help="create a user and print its first API token")
    p.add_argument("name")
    p.add_argument("--admin", action="store_true", help="may see and act on everyone's jobs")
    p.set_defaults(fn=cmd_admin_create_user)
    p = sub.add_parser("stack", help="run redis-server, the API and a worker on this machine")
    p.add_argument("--root", default=".shardyard")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--demo", action="store_true", help="submit the demo job and follow it")
    p.set_defaults(fn=cmd_stack)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CliError as e:
        err.print(f"[red]error:[/] {shown(e)}")
        return 2
    except httpx.ConnectError:
        err.print(
            f"[red]error:[/] cannot reach the API at {args.api} (is `shardyard serve` or `make demo` running?)"
        )
        return 2
    except httpx.TransportError as e:
        err.print(f"[red]error:[/] lost the connection to the API at {args.api}: {e or type(e).__name__}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
