"""API latency under load on the real embedded stack (redis-server, uvicorn with one process, one
Celery worker, SQLite WAL): 50 Server-Sent Event streams open on a job that trains and streams its
metrics the whole time, 20 submits per second (open loop: each POST starts on its schedule,
whether or not the previous one answered), and a probe issuing the reads the dashboard and CLI
make and Prometheus' scrape. Every request's latency is kept; the table gives p50/p95/p99 per route
and overall. Goals: p99 <= 100 ms on every route, and p95 <= 50 ms for a job's metric series. At
scale (`--streams 500 --jobs 10`: the streams spread over 10 jobs that train at once on one
worker, the trainers at the lowest CPU priority as stand-ins for GPU nodes, the probe's job reads turning
through them) the p99 goal is 150 ms.

    python -m bench.api_load [--streams 50] [--jobs 1] [--submits-per-s 20] [--seconds 30]

Writes bench/results/api_load.json naming the machine and its load average during the run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import selectors
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from api.stack import Stack
from bench.common import add_load_options, table, write_results

# a job that trains for the whole run (one-layer MLP: many small steps, a steady metric stream)
STREAMED = {
    "name": "streamed",
    "model": {"kind": "mlp", "layers": 1, "d_model": 16, "seq_len": 8},
    "data": {"max_chars": 20_000},
    "train": {"steps": 1_000_000, "batch_size": 2, "eval_every": 1000, "eval_batches": 1},
}
GOAL_P99_MS = 100
GOAL_P99_MS_AT_SCALE = 150
"""The goal with more than 50 streams (500 streams over 10 running jobs)."""
GOAL_SERIES_P95_MS = 50
SERIES_ROUTE = "GET /api/jobs/{id}/metrics"
SUBMITTED = {**STREAMED, "name": "queued", "train": {**STREAMED["train"], "steps": 10}}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def _drain_streams(
    port: int,
    paths: list[tuple[str, int]],
    token: str,
    nice: int,
    conn: multiprocessing.connection.Connection,
) -> None:
    """The stream clients' process: open `n` raw SSE connections on each path, say so on `conn`,
    drain them all with one selector until `conn` says stop, then send (bytes read, closed early)."""
    os.nice(nice)
    sel = selectors.DefaultSelector()
    try:
        for path, n in paths:
            for _ in range(n):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                auth = f"Authorization: Bearer {token}\r\n"
                s.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Accept: text/event-stream\r\n\r\n".encode()
                )
                head = s.recv(4096)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"stream refused: {head[:200]!r}")
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
    except Exception as e:  # noqa: BLE001 - the bench's process raises it
        conn.send(("error", repr(e)))
        return
    conn.send(("open", None))
    got, closed = 0, 0
    while not conn.poll():
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except OSError:  # reset by the server: counted as closed early, like an end
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
            got += len(data)
    conn.send(("done", (got, closed)))
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


class Streams:
    """The raw SSE connections, drained by one selector in a process of their own (what they cost
    the server, not the bench): in the bench's process, 500 streams' reads took the interpreter
    from the threads that time the requests, and a request's time then counted the wait for it.
    `nice`: the clients' CPU priority (they stand in for browsers on other machines)."""

    def __init__(self, port: int, paths: list[tuple[str, int]], token: str, *, nice: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_drain_streams, args=(port, paths, token, nice, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(300):
            raise RuntimeError("the stream clients did not open their streams within 300 s")
        kind, detail = self._conn.recv()
        if kind != "open":
            raise RuntimeError(f"stream clients: {detail}")
        self.bytes = 0
        self.closed = 0

    @property
    def pid(self) -> int:
        return int(self._proc.pid or 0)

    def close(self) -> None:
        self._conn.send("stop")
        if self._conn.poll(30):
            _, (self.bytes, self.closed) = self._conn.recv()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


def _gc_pauses(exposition: str) -> dict[str, dict[str, float]]:
    """{generation: {"n": collections, "s": seconds held, "over_50ms": collections}} of the API
    process (shardyard_gc_pause_seconds)."""
    out: dict[str, dict[str, float]] = {}
    for line in exposition.splitlines():
        if not line.startswith("shardyard_gc_pause_seconds"):
            continue
        name, _, value = line.rpartition(" ")
        gen = name.split('generation="', 1)[1].split('"', 1)[0] if 'generation="' in name else "?"
        row = out.setdefault(gen, {"n": 0.0, "s": 0.0, "over_50ms": 0.0})
        if name.startswith("shardyard_gc_pause_seconds_count"):
            row["n"] = float(value)
        elif name.startswith("shardyard_gc_pause_seconds_sum"):
            row["s"] = round(float(value), 3)
        elif 'le="0.05"' in name:
            row["over_50ms"] = -float(value)  # the count comes below: over = count - under
    for row in out.values():
        row["over_50ms"] = row["n"] + row["over_50ms"]
    return out


def _stream_reads(exposition: str) -> dict[str, dict[str, float]]:
    """{"reads"|"rows": {why: count}} from the API's Prometheus text (shardyard_sse_database_*)."""
    out: dict[str, dict[str, float]] = {"reads": {}, "rows": {}}
    for line in exposition.splitlines():
        for kind in ("reads", "rows"):
            head = f'shardyard_sse_database_{kind}_total{{why="'
            if line.startswith(head):
                why, _, value = line[len(head) :].partition('"} ')
                out[kind][why] = float(value)
    return out


class _Timed:
    """Every request's latency by route, its start (seconds after the first request) and the
    error answers, from any thread; each thread keeps its own client."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.lat: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.when: list[tuple[float, str, float]] = []  # (seconds after the first request, route, ms)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._begun = time.perf_counter()

    def __call__(self, route: str, method: str, url: str, **kw: object) -> None:
        if not hasattr(self._local, "client"):
            self._local.client = _client(self.stack)
        t0 = time.perf_counter()
        r = self._local.client.request(method, url, **kw)
        dt = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self.lat.setdefault(route, []).append(dt)
            self.when.append((t0 - self._begun, route, dt))
            if r.status_code >= 400:
                key = f"{route} {r.status_code}"
                self.errors[key] = self.errors.get(key, 0) + 1


def _client(stack: Stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {stack.admin_token}"}
    )


def run(
    stack: Stack,
    *,
    streams: int,
    rate: float,
    seconds: float,
    jobs: int = 1,
    clients_nice: int = 0,
    trainer_nice: int = 0,
) -> dict:
    timed = _Timed(stack)
    with _client(stack) as c:
        trained = _start_training(c, jobs)
        priorities = _trainer_priorities(stack)
        opened = _open_streams(stack, trained, streams, nice=clients_nice)
        load = [os.getloadavg()[0]]
        cpu_before = {who: _cpu_s(pid) for who, pid in _measured(stack, opened).items()}
        steps_before = _steps(c, trained)
        api_waited = _waited_s(stack.procs["api"].pid)
        stop = threading.Event()
        prober = threading.Thread(target=_probe, args=(timed, trained, stop), daemon=True)
        prober.start()
        t0 = time.monotonic()
        achieved = _submit(timed, rate=rate, seconds=seconds, load=load)
        steps_after = _steps(c, trained)
        streamed_step = min(steps_after)
        stop.set()
        prober.join(timeout=10)
        wall = time.monotonic() - t0
        cpu = {
            who: round((_cpu_s(pid) - cpu_before[who]) / wall, 3)
            for who, pid in _measured(stack, opened).items()
        }
        # the time the API's threads were ready to run and waited for a core: how much of a
        # request's time was the machine's, not the API's
        cpu["api_waited_for_a_core"] = round(
            _waited_between(api_waited, _waited_s(stack.procs["api"].pid)) / wall, 3
        )
        load.append(os.getloadavg()[0])
        opened.close()
        delivered, dropped = opened.bytes, opened.closed
        _cancel_all(c, streamed=[j["id"] for j in trained])
        # what the streams read from the database (core/telemetry.py): counts the machine's load
        # does not move, beside the walls it does
        exposition = c.get("/metrics").text
        stream_db = _stream_reads(exposition)
        gc_pauses = _gc_pauses(exposition)
    every = [x for xs in timed.lat.values() for x in xs]
    routes = {r: {**_percentiles(xs), "max_ms": max(xs)} for r, xs in sorted(timed.lat.items())}
    return {
        "streams": streams,
        "jobs": jobs,
        "trainers_nice": trainer_nice,
        # each trainer's [session nice value, its threads' nice values...] as the run began
        "trainer_priorities": priorities,
        "clients_nice": clients_nice,
        # CPU-seconds a second over the run, of the API's process (its threads) and of the stream
        # clients' and the bench's own: what the load took from the API, apart from the walls
        "cpu_s_per_s": cpu,
        "stream_bytes": delivered,
        "streams_closed_early": dropped,
        "streamed_job_step": streamed_step,
        # how fast the streamed jobs trained during the run: what their streams carried live
        "streamed_steps_per_s": round(
            sum(b - a for a, b in zip(steps_before, steps_after, strict=True)) / wall, 2
        ),
        "stream_database_reads": stream_db,
        # the API process held still by its garbage collector over the whole stack's life
        "gc_pauses": gc_pauses,
        "submits_per_s_target": rate,
        "submits_per_s_achieved": achieved,
        "seconds": seconds,
        "load_average_1m": load,
        "errors": timed.errors,
        "routes": routes,
        # where the tail sits in time: requests that started together and were slow together
        # point at one stall of the API process, scattered ones at the machine's scheduling
        "slowest": [
            {"at_s": round(at, 3), "route": r, "ms": round(ms, 1)}
            for at, r, ms in sorted(timed.when, key=lambda w: -w[2])[:20]
        ],
        "all": _percentiles(every),
    }


def _start_training(c: httpx.Client, jobs: int) -> list[dict]:
    """Submit `jobs` streamed jobs and wait until each has trained 5 steps (at most 600 s)."""
    trained = [c.post("/api/jobs", json=STREAMED).json() for _ in range(jobs)]
    deadline = time.monotonic() + 600
    for j in trained:
        while (got := c.get(f"/api/jobs/{j['id']}").json())["progress"]["step"] < 5:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {j['id']} did not start training: {got['wait_reason']}")
            time.sleep(0.2)
    return trained


def _open_streams(stack: Stack, trained: list[dict], streams: int, *, nice: int = 0) -> Streams:
    """The streams spread evenly over the running jobs (a job's frames are built once for all of
    its streams: api/sse.py)."""
    jobs = len(trained)
    per = [streams // jobs + (1 if k < streams % jobs else 0) for k in range(jobs)]
    paths = [(f"/api/jobs/{j['id']}/stream", n) for j, n in zip(trained, per, strict=True) if n]
    return Streams(stack.api_port, paths, stack.admin_token, nice=nice)


def _probe(timed: _Timed, trained: list[dict], stop: threading.Event) -> None:
    """The dashboard's, the CLI's and Prometheus' reads in turn, one every 0.1 s until `stop`."""
    i = 0
    while not stop.is_set():
        j = trained[(i // 5) % len(trained)]  # each round of the routes on the next job
        routes = [
            ("GET /api/jobs", "/api/jobs", {"limit": 50}),
            ("GET /api/jobs/{id}", f"/api/jobs/{j['id']}", {}),
            ("GET /api/jobs/{id}/metrics", f"/api/jobs/{j['id']}/metrics", {"max_points": 200}),
            ("GET /api/health", "/api/health", {}),
            ("GET /metrics", "/metrics", {}),
        ]
        route, url, params = routes[i % len(routes)]
        timed(route, "GET", url, params=params)
        i += 1
        time.sleep(0.1)


def _submit(timed: _Timed, *, rate: float, seconds: float, load: list[float]) -> float:
    """`rate` submits a second for `seconds`, open loop (the k-th starts at k / rate seconds,
    answered or not), the load average into `load` every 5 s; returns the rate achieved."""
    t0 = time.perf_counter()
    n = int(rate * seconds)
    with ThreadPoolExecutor(16) as pool:
        for k in range(n):
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(timed, "POST /api/jobs", "POST", "/api/jobs", json=SUBMITTED)
            if k % int(rate * 5) == 0:
                load.append(os.getloadavg()[0])
    return n / (time.perf_counter() - t0)


def _waited_s(pid: int) -> dict[int, float]:
    """Seconds each of `pid`'s threads has spent runnable and waiting for a CPU (/proc's
    schedstat), by thread id."""
    out = {}
    for tid in _threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            pass  # ended meanwhile
    return out


def _waited_between(before: dict[int, float], after: dict[int, float]) -> float:
    """The wait of the threads alive at both samples, plus all of those started between (a
    thread that ended between is left out: its last figure is not known)."""
    return sum(w - before.get(tid, 0.0) for tid, w in after.items())


def _steps(c: httpx.Client, trained: list[dict]) -> list[int]:
    return [c.get(f"/api/jobs/{j['id']}").json()["progress"]["step"] for j in trained]


def _measured(stack: Stack, opened: Streams) -> dict[str, int]:
    return {"api": stack.procs["api"].pid, "stream_clients": opened.pid, "bench": os.getpid()}


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds `pid` has used (its threads together)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _trainer_priorities(stack: Stack) -> list[list[int]]:
    """[session nice, thread nices...] of each trainer: they stand in for GPU nodes, which do not
    share the API's cores, and run at the lowest CPU priority (`SHARDYARD_TRAINER_NICE=19`,
    trainer/priority.py). On this 2-core machine ten CPU trainers at the API's priority take
    nearly every cycle, which measures the machine, not the API. Their session counts as much as
    their threads: with the kernel's autogroups on (this VM's are), the CPU is shared between
    sessions first, and each trainer has one of its own (the runs before the setting reniced only
    the threads from outside, and ten trainers held ten shares against the API's one). The
    workers' own processes keep the API's priority: their relays take SQLite's write lock, and a
    relay preempted at nice 19 while it holds it keeps the API's writes waiting."""
    out = []
    for name, proc in stack.procs.items():
        if name.startswith("worker"):
            for pid in _descendants(proc.pid):
                if _runs_trainer(pid):
                    group = _autogroup_nice(pid)
                    out.append([group, *(_thread_nice(pid, tid) for tid in _threads(pid))])
    return out


def _autogroup_nice(pid: int) -> int:
    """The nice value of `pid`'s session (its autogroup; -1 without them)."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return -1


def _thread_nice(pid: int, tid: int) -> int:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except (OSError, ValueError, IndexError):
        return -1


def _runs_trainer(pid: int) -> bool:
    """Whether `pid` is a trainer (`python -m trainer`, sandboxed or not, or a spare one, whose
    command line stays `-m trainer.zygote` when it takes a job), not the sandbox around it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").split()  # a title it set has spaces instead
    except OSError:
        return False
    if not argv or Path(argv[0].decode(errors="replace")).name == "bwrap":
        return False
    return any(a == b"-m" and b.split(b".")[0] == b"trainer" for a, b in zip(argv, argv[1:], strict=False))


def _threads(pid: int) -> list[int]:
    """The thread ids of `pid` (itself alone when /proc does not list them)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _percentiles(xs: list[float]) -> dict[str, float]:
    """How many requests, and their median, 95th and 99th percentile times."""
    return {"n": len(xs), "p50_ms": pct(xs, 0.5), "p95_ms": pct(xs, 0.95), "p99_ms": pct(xs, 0.99)}


def _cancel_all(c: httpx.Client, *, streamed: list[int]) -> None:
    """Leave nothing behind for the stack's stop: cancel what queued up and the streamed jobs."""
    while queued := c.get("/api/jobs", params={"status": "queued", "limit": 500}).json()["items"]:
        for j in queued:
            c.post(f"/api/jobs/{j['id']}/cancel")
    for job_id in streamed:
        c.post(f"/api/jobs/{job_id}/cancel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_options(ap, name="api_load")
    ap.add_argument("--jobs", type=int, default=1, help="running jobs the streams are spread over")
    ap.add_argument(
        "--trainer-nice",
        type=int,
        default=19,
        help="the trainers' nice value with --jobs above 1 (SHARDYARD_TRAINER_NICE; 19: GPU nodes' stand-ins)",
    )
    ap.add_argument(
        "--clients-nice",
        type=int,
        default=0,
        help="CPU priority of the stream clients' process (they stand in for browsers elsewhere)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # one client opens all the streams: raise its cap above them
        # a request waiting 0.5 s has the API log every thread's stack (api/stalls.py): the runs'
        # worst stalls were 1.2-4.7 s, under the service's default of 2 s for some
        env = {"SHARDYARD_SSE_MAX_PER_CLIENT": str(args.streams + 10), "SHARDYARD_STALL_LOG_S": "0.5"}
        # the worker takes every streamed job at once, whatever this machine's core count
        env["SHARDYARD_WORKER_SLOTS"] = str(max(args.jobs, 2))
        trainer_nice = args.trainer_nice if args.jobs > 1 else 0
        if args.jobs > 1:  # the trainers stand in for GPU nodes (_trainer_priorities)
            env["SHARDYARD_TRAINER_NICE"] = str(trainer_nice)
        env["SHARDYARD_QUOTA_RUNNING_JOBS"] = str(max(args.jobs, 4))  # the admin's, who runs them
        # one worker runs every streamed job at once (a task each)
        with Stack(root=Path(tmp), workers=1, concurrency=args.jobs, extra_env=env, shutdown_s=60) as stack:
            res = run(
                stack,
                streams=args.streams,
                rate=args.submits_per_s,
                seconds=args.seconds,
                jobs=args.jobs,
                clients_nice=args.clients_nice,
                trainer_nice=trainer_nice,
            )
            # what the API logged of requests that waited over SHARDYARD_STALL_LOG_S (api/stalls.py)
            api_log = (Path(tmp) / "api.log").read_text(errors="replace")
            res["stall_reports"] = [
                "request(s) waiting over" + part.split("\n\n\n")[0][:20000]
                for part in api_log.split("request(s) waiting over")[1:]
            ]
    rows = [
        {"route": r, "requests": v["n"], "p50 ms": v["p50_ms"], "p95 ms": v["p95_ms"], "p99 ms": v["p99_ms"]}
        for r, v in res["routes"].items()
    ]
    a = res["all"]
    rows.append(
        {
            "route": "all",
            "requests": a["n"],
            "p50 ms": a["p50_ms"],
            "p95 ms": a["p95_ms"],
            "p99 ms": a["p99_ms"],
        }
    )
    goal = GOAL_P99_MS if res["streams"] <= 50 else GOAL_P99_MS_AT_SCALE
    met = all(v["p99_ms"] <= goal for v in res["routes"].values()) and (
        res["routes"].get(SERIES_ROUTE, {}).get("p95_ms", 0) <= GOAL_SERIES_P95_MS
    )
    title = (
        f"API latency with {res['streams']} open streams and {res['submits_per_s_achieved']:.1f} submits/s "
        f"for {res['seconds']:.0f} s (goal: p99 <= {goal} ms on every route, p95 <= "
        f"{GOAL_SERIES_P95_MS} ms for {SERIES_ROUTE}); load average "
        f"{min(res['load_average_1m']):.1f}-{max(res['load_average_1m']):.1f}; errors {res['errors'] or 'none'}"
    )
    print(table(rows, title=title))
    slow = ", ".join(f"{w['route']} {w['ms']:.0f} ms at {w['at_s']:.1f} s" for w in res["slowest"][:8])
    print(f"slowest: {slow}")
    print(f"stall reports in the API's log: {len(res['stall_reports'])} (in the JSON's stall_reports)")
    print(f"streams' database reads (and rows framed), by why: {res['stream_database_reads']}")
    print(f"the API's garbage collections, by generation: {res['gc_pauses']}")
    print(
        f"CPU-seconds a second: {res['cpu_s_per_s']}; streamed jobs' steps a second: {res['streamed_steps_per_s']}"
    )
    goals = {"goal_p99_ms": goal, "goal_series_p95_ms": GOAL_SERIES_P95_MS, "met": met}
    print(f"wrote {write_results(args.name, {**goals, **res})}")


if __name__ == "__main__":
    main()
