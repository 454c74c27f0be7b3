"""Shardyard beside a bare process pool and Ray Tune, on the same trials of the same trainer loop.

    python -m bench.peer [--reps 3] [--steps 60] [--sides bare,executor,rest,ray,ray-reuse] [--modes fifo,asha]
    (sides also: executor-threads, executor-nochunk, rest-unsandboxed)
    python -m bench.peer --search [--reps 5] [--steps 60] [--parallel 2] [--out peer_search]

The trials: a grid of `train.lr` x `model.layers` on the built-in GPT, val_loss every 10 steps, two
CPU "devices" (two cores). Each side runs them FIFO (every trial to its end) and with ASHA
(reduction factor 2, first rung at step 10), the sides interleaved within each repetition:

- bare: the floor with no orchestrator: a 2-process pool (`multiprocessing`, spawn) running
  trainer/loop.py's `train` per trial, one torch thread each. FIFO only (no early stopping).
- executor: `python -m trainer.selection` alone (Shardyard's executor, shard alternation over 2
  devices, Sharded-LRTF), a fresh process as a user would start it (it imports torch each time);
  its two CPU devices are forked device processes.
- executor-fused: the same batch with fusion on, the default (the executor sides above set
  `"fuse": false`): its CPU-seconds beside the executor's are the default's cost against no fusion
  on a machine whose wall times the other processes decide. Each run measures the step costs its
  plan needs, as the first batch of an architecture on a worker host does.
- executor-fused-host: the same with the step costs a worker host keeps (workers/step_costs.py:
  the file handed to the trainer with `--step-costs`, what it measured taken back from its summary),
  one host for the whole bench run: its first run measures, the later ones plan from the kept lines.
- executor-threads: the same with `--device-threads` (the two devices as threads of one process,
  the executor before device processes), to compare on the same machine in the same run.
- executor-nochunk: device processes with `--chunk-tasks 1` (one task an order: the executor before
  a lone trial's tasks went in chunks), to compare in the same run.
- rest: the same batch through `POST /api/selections` on an embedded stack as deployed
  (redis-server, uvicorn, one Celery worker, SQLite, the sandbox on: each group starts fresh in
  its bubblewrap sandbox, workers/sandbox.py); timed from the submit to the batch's end (server clock),
  the client reading the batch every 0.5 s meanwhile.
- rest-nofuse: the same batch with `"fuse": false` (every trial alone through the executor, as
  before fusion was the default); `rest` is the default, fusion where the plan says it pays
  (trainer/selection/fusion_plan.py). Both sides read each trial's training loss series back, and
  the summary compares every fused trial's curve with its unfused run in the same repetition.
- rest-unsandboxed: the same on a second stack whose workers run with SHARDYARD_SANDBOX=off (each
  group forked from the warm trainer, no bubblewrap): what the sandbox costs a batch.
- ray / ray-reuse: Ray Tune (`Tuner`, a function trainable running trainer/loop.py's `train`, one
  CPU per trial, `ray.init(num_cpus=2)` done before timing), with `reuse_actors` off (Ray's
  default) and on; FIFOScheduler or ASHAScheduler(grace_period=1 report = 10 steps, rf 2).

`--search`: model-based search on the same 8-point grid, where the answer is known (every point's
best val_loss is the grid's, each point computed once per repetition by the REST grid run). One
repetition per seed (0 .. reps-1), interleaved: `rest-grid` (the grid through REST, as above, with
`"fuse": false`: the unfused grid; a sampler's batch never fuses),
`rest-tpe` (`method: tpe`, 8 trials, `parallel` 2 or --parallel, 4 random startup trials, the seed) and
`ray-optuna` (Ray Tune with `OptunaSearch` over the same two choices: Optuna's TPESampler with the
same seed, startup trials and `constant_liar`, 8 samples, `ConcurrencyLimiter` 2, one CPU per trial;
each trial reports its best val_loss so far, the value Shardyard's sampler is told). Each reports
its wall, the best value it found and the best value after each trial (by trial index, from the
grid's values of the points asked), and how many points it ran twice. Writes
bench/results/peer_search.json.

Every side reports the best trial's parameters and val_loss, so a fast wrong answer shows. The
work floor is the bare side's summed per-trial training time over two cores. The bare and executor
sides also report their CPU-seconds: user + system time of every process the side ran (the pool's
workers; the executor's process and its device processes), from getrusage(RUSAGE_CHILDREN) around
the run; on a shared, loaded machine CPU time is what stays comparable, where wall time measures the
scheduler's shares. Checkpoints are off on
every side (Shardyard: `checkpoints: none`). Prints a table, the load average around the runs and
how many REST groups ran warm, and writes bench/results/peer.json with the machine and the load
average around each run (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS, machine, table, write_results
from core.settings import Settings
from jobrules.space import expand
from workers import step_costs
from workers.selection import selection_command

ROOT = Path(__file__).resolve().parents[1]
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
LAYERS = [2, 4]
SPACE = {"train.lr": LRS, "model.layers": LAYERS}
MODES = ("fifo", "asha")
ASHA = {"kind": "asha", "reduction_factor": 2, "min_steps": 10}
REST_POLL_S = 0.5
"""How often the REST side reads the batch while waiting. Its wall is the server's (created_at to
finished_at), so this sets only what the waiting costs the machine: at 0.05 s the reads took ~3 s
of the API's CPU per 25 s batch, on the 2 cores the trials train on."""


def base_spec(steps: int) -> dict[str, Any]:
    return {
        "name": "peer",
        "model": {"kind": "gpt", "layers": 2, "d_model": 64, "heads": 4, "seq_len": 64},
        "data": {"kind": "text", "corpus": "stdlib", "max_chars": 1_000_000},
        "train": {
            "steps": steps,
            "batch_size": 16,
            "lr": 1e-3,
            "eval_every": 10,
            "eval_batches": 2,
            "seed": 0,
        },
        "resources": {"device": "cpu"},
    }


def trials(steps: int) -> list[dict[str, Any]]:
    """(index, params, spec) as the API expands the grid."""
    return [
        {"index": p.index, "params": p.params, "spec": p.spec}
        for p in expand(base=base_spec(steps), space=SPACE, method="grid")
    ]


def best_of(per_trial: dict[int, dict[str, Any]], params: dict[int, dict]) -> dict[str, Any]:
    """The trial with the lowest val_loss at the last step it ran (ties to the lower index)."""
    scored = [(r["val_loss"], i) for i, r in per_trial.items() if r.get("val_loss") is not None]
    v, i = min(scored)
    return {"trial": i, "params": params[i], "val_loss": v, "steps": per_trial[i]["steps"]}


# -- bare: a process pool, no orchestrator --------------------------------------------------------


def children_cpu_s() -> float:
    """User + system seconds of this process's waited-for children (and theirs) so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _bare_trial(t: dict[str, Any]) -> tuple[int, float, int, float]:
    import torch

    from trainer.config import load_job
    from trainer.protocol import NeverStop, NullSink
    from trainer.runner import run

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = run(load_job(t["spec"]), sink=NullSink(), stop=NeverStop(), device=torch.device("cpu"))
    return t["index"], float(res["val_loss"]), int(res["steps"]), time.perf_counter() - t0


def run_bare(ts: list[dict[str, Any]]) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), children_cpu_s()
    pool = mp.get_context("spawn").Pool(2)
    out = pool.map(_bare_trial, ts, chunksize=1)
    wall = time.perf_counter() - t0
    pool.close()
    pool.join()  # the workers exit and are waited for, so their CPU time is counted
    cpu = children_cpu_s() - c0
    per = {i: {"val_loss": v, "steps": s, "seconds": sec} for i, v, s, sec in out}
    return {"wall_s": wall, "cpu_s": cpu, "trials": per, "work_s": sum(r["seconds"] for r in per.values())}


# -- Shardyard: the executor alone, and through the REST API --------------------------------------


def batch_doc(ts: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    return {
        "trials": [{"index": t["index"], "spec": t["spec"]} for t in ts],
        "metric": "val_loss",
        "mode": "min",
        "scheduler": "shard-lrtf",
        "early_stopping": ASHA if mode == "asha" else None,
        "seed": 0,
        "checkpoints": "none",
        "fuse": False,  # the executor sides measure the executor: every trial alone
    }


EXECUTOR_SIDES = {
    "executor": (),
    "executor-threads": ("--device-threads",),
    "executor-nochunk": ("--chunk-tasks", "1"),
}
"""The executor sides: `python -m trainer.selection`'s extra arguments."""


def run_executor(
    ts: list[dict[str, Any]],
    mode: str,
    tmp: Path,
    *,
    extra: tuple[str, ...] = (),
    fuse: bool = False,
    host: Settings | None = None,
    device: str = "cpu",
    devices: int = 2,
    curves: bool = False,
) -> dict[str, Any]:
    """`host`: a worker host whose kept step costs the run plans with and adds to (the worker's
    two calls around its group, inside the timing as they are in a group's). `device` and
    `devices`: the executor's --device and --devices. `curves`: also each trial's training loss
    by step, from its metric lines ("curves": {trial: {step: loss}})."""
    path = tmp / f"batch-{mode}.json"
    path.write_text(json.dumps({**batch_doc(ts, mode), "fuse": fuse}))
    costs = tmp / f"batch-{mode}.step-costs.json"
    t0, c0 = time.perf_counter(), children_cpu_s()
    if host is not None:
        step_costs.hand_over(host, costs, owner=None, own_code=False)
        extra = (*extra, "--step-costs", str(costs))
    cmd = selection_command(path, devices, "--device", device, *extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer.selection exited {proc.returncode}: {proc.stderr[-2000:]}")
    summary = next(json.loads(line)["data"] for line in proc.stdout.splitlines() if '"batch_result"' in line)
    if host is not None:
        step_costs.learn(host, summary, owner=None, own_code=False)
    wall = time.perf_counter() - t0
    cpu = children_cpu_s() - c0
    per = {
        r["trial"]: {
            "val_loss": r["val_loss"],
            "steps": r["steps"],
            "status": r["status"],
            "fused_with": r.get("fused_with"),
        }
        for r in summary["trials"]
    }
    out = {"wall_s": wall, "cpu_s": cpu, "trials": per, "fusion": summary.get("fusion")}
    if curves:
        out["curves"] = loss_curves(proc.stdout)
    return out


def loss_curves(stdout: str) -> dict[int, dict[int, float]]:
    """Each trial's training loss by step, from the executor's protocol lines."""
    out: dict[int, dict[int, float]] = {}
    for line in stdout.splitlines():
        if '"metric"' not in line:
            continue
        m = json.loads(line)
        if m.get("kind") == "metric" and m.get("name") == "loss" and m.get("trial") is not None:
            out.setdefault(int(m["trial"]), {})[int(m["step"])] = float(m["value"])
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _ts(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def run_selection(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """Submit the batch over REST and poll it until it ends; it must have succeeded."""
    r = client.post("/api/selections", json=body)
    r.raise_for_status()
    sid = r.json()["id"]
    while True:
        sel = client.get(f"/api/selections/{sid}").json()
        if sel["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(REST_POLL_S)
    if sel["status"] != "succeeded":
        raise RuntimeError(f"selection {sid} ended {sel['status']}: {sel.get('error')}")
    return sel


def rest_batch(steps: int, mode: str, *, fuse: bool = True) -> dict[str, Any]:
    """The REST side's selection request: the grid over 2 devices, FIFO or ASHA, no checkpoints
    (bench/rest_timeline.py submits the same one); `fuse` False: every trial alone."""
    return {
        "fuse": fuse,
        "name": f"peer-{mode}",
        "base": base_spec(steps),
        "space": SPACE,
        "method": "grid",
        "devices": 2,
        "scheduler": "shard-lrtf",
        "early_stopping": ASHA if mode == "asha" else None,
        "checkpoints": "none",
    }


def run_rest(client: httpx.Client, steps: int, mode: str, *, fuse: bool = True) -> dict[str, Any]:
    body = rest_batch(steps, mode, fuse=fuse)
    t0 = time.perf_counter()
    sel = run_selection(client, body)
    client_wall = time.perf_counter() - t0
    per = {}
    curves: dict[int, list[float]] = {}
    for t in sel["trials"]:
        result = t.get("result") or client.get(f"/api/jobs/{t['job_id']}").json()["result"] or {}
        per[t["index"]] = {
            "val_loss": result.get("val_loss"),
            "steps": t["steps_done"],
            "status": t["status"],
            "fused_with": t.get("fused_with"),
        }
        # read after the timed wall: the loss curve, to compare fused with unfused
        series = client.get(f"/api/jobs/{t['job_id']}/metrics", params={"names": "loss"}).json()
        curves[t["index"]] = series["series"]["loss"]["values"]
    return {
        "wall_s": _ts(sel["finished_at"]) - _ts(sel["created_at"]),
        "client_wall_s": client_wall,
        "trials": per,
        "curves": curves,
    }


# -- Ray Tune --------------------------------------------------------------------------------------


def _ray_trial(config: dict[str, Any], specs: list[dict[str, Any]]) -> None:
    import torch
    from ray import tune

    from trainer.config import load_job
    from trainer.protocol import NeverStop, NullSink
    from trainer.runner import run

    class Report(NullSink):
        def metric(self, step: int, name: str, value: float) -> None:
            if name == "val_loss":
                tune.report({"val_loss": float(value), "step": step})

    torch.set_num_threads(1)
    spec = specs[config["index"]]
    run(load_job(spec), sink=Report(), stop=NeverStop(), device=torch.device("cpu"))


def run_ray(ts: list[dict[str, Any]], mode: str, *, reuse: bool, steps: int, tmp: Path) -> dict[str, Any]:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    scheduler = (
        ASHAScheduler(time_attr="training_iteration", max_t=steps // 10, grace_period=1, reduction_factor=2)
        if mode == "asha"
        else FIFOScheduler()
    )
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(_ray_trial, specs=[t["spec"] for t in ts]), {"cpu": 1}),
        param_space={"index": tune.grid_search([t["index"] for t in ts])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", scheduler=scheduler, reuse_actors=reuse),
        run_config=tune.RunConfig(storage_path=str(tmp / "ray"), verbose=0),
    )
    t0 = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - t0
    per = {}
    for res in grid:
        i = res.config["index"]
        per[i] = {"val_loss": res.metrics.get("val_loss"), "steps": res.metrics.get("step", 0)}
    return {"wall_s": wall, "trials": per}


# -- model-based search: Shardyard's TPE over REST beside Ray Tune's OptunaSearch ---------------------

STARTUP = 4
"""Random trials before TPE's model, on both sides (Optuna's default, 10, is more than 8 trials)."""


def _point(params: dict[str, Any]) -> tuple[float, int]:
    return float(params["train.lr"]), int(params["model.layers"])


def run_rest_search(
    client: httpx.Client,
    steps: int,
    *,
    method: str,
    seed: int,
    parallel: int = 2,
    scheduler: str = "shard-lrtf",
    data_dir: Path | None = None,
) -> dict[str, Any]:
    """The batch through REST: the grid, or TPE with `seed` and `parallel`; its trials' points and
    best val_loss by trial index, and (from the stack's `data_dir`) its groups' device idle
    seconds: time a device had no trial to run before its group's end (asking included)."""
    body: dict[str, Any] = {
        "name": f"peer-{method}",
        "base": base_spec(steps),
        "space": SPACE,
        "method": method,
        "devices": 2,
        "checkpoints": "none",
        "seed": seed,
        "scheduler": scheduler,
    }
    if method == "tpe":
        body.update(trials=8, parallel=parallel, startup_trials=STARTUP)
    else:
        body["fuse"] = False  # the unfused grid, which the TPE goal compares with
    sel = run_selection(client, body)
    ts = sorted(sel["trials"], key=lambda t: t["index"])
    groups = [
        json.loads(f.read_text())
        for f in sorted((data_dir / "selections" / str(sel["id"])).glob("group-*.summary.json"))
        if data_dir is not None
    ]
    return {
        "wall_s": _ts(sel["finished_at"]) - _ts(sel["created_at"]),
        "points": [_point(t["params"]) for t in ts],
        "values": [t["best_metric"] for t in ts],
        "repeats_skipped": {t["index"]: t.get("repeats_skipped") for t in ts if t.get("repeats_skipped")},
        "error": sel.get("error"),
        "busy_s": [(t.get("result") or {}).get("busy_s") for t in ts],
        "groups": len(groups),
        "makespan_s": sum(g["makespan_s"] for g in groups),
        "idle_s": [x for g in groups for x in g.get("idle_s") or []],
        "ask_s": [x for g in groups for x in g.get("ask_s") or []],
    }


def _ray_point(config: dict[str, Any], base: dict[str, Any]) -> None:
    import torch
    from ray import tune

    from jobrules.space import apply_params
    from trainer.config import load_job
    from trainer.protocol import NeverStop, NullSink
    from trainer.runner import run

    class Report(NullSink):
        best = float("inf")

        def metric(self, step: int, name: str, value: float) -> None:
            if name == "val_loss":
                # the best so far: the value Shardyard's sampler is told (a trial's best metric)
                self.best = min(self.best, float(value))
                tune.report({"val_loss": self.best, "step": step})

    torch.set_num_threads(1)
    spec = apply_params(base, {"train.lr": config["lr"], "model.layers": config["layers"]})
    run(load_job(spec), sink=Report(), stop=NeverStop(), device=torch.device("cpu"))


def run_ray_optuna(steps: int, *, seed: int, tmp: Path) -> dict[str, Any]:
    import optuna
    from optuna.distributions import CategoricalDistribution
    from ray import tune
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch

    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=STARTUP, constant_liar=True)
    search = OptunaSearch(
        space={"lr": CategoricalDistribution(LRS), "layers": CategoricalDistribution(LAYERS)},
        metric="val_loss",
        mode="min",
        sampler=sampler,
    )
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(_ray_point, base=base_spec(steps)), {"cpu": 1}),
        tune_config=tune.TuneConfig(
            search_alg=ConcurrencyLimiter(search, max_concurrent=2), num_samples=8, reuse_actors=False
        ),
        run_config=tune.RunConfig(
            storage_path=str(tmp / "ray"), name=f"optuna-{seed}-{time.time_ns()}", verbose=0
        ),
    )
    t0 = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - t0
    rs = sorted(grid, key=_ray_order)
    return {
        "wall_s": wall,
        "points": [(float(r.config["lr"]), int(r.config["layers"])) for r in rs],
        "values": [r.metrics.get("val_loss") for r in rs],
    }


def _ray_order(result: Any) -> int:
    """The order the searcher asked a trial in: Ray's experiment tag ("3_layers=2,lr=0.001") or,
    failing that, the same number in the trial's folder name."""
    import re

    tag = str(result.metrics.get("experiment_tag") or "")
    if re.match(r"\d+_", tag):
        return int(tag.split("_", 1)[0])
    m = re.search(r"_(\d+)_layers=", os.path.basename(str(result.path)))
    if m is None:
        raise RuntimeError(f"cannot tell the order of Ray trial {result.path}")
    return int(m.group(1))


def curve(points: list[tuple[float, int]], truth: dict[tuple[float, int], float]) -> list[float]:
    """The best of the grid's values over the points asked so far, after each trial."""
    out, best = [], float("inf")
    for p in points:
        best = min(best, truth[p])
        out.append(best)
    return out


def start_stack(tmp: Path, *, sandbox: str = "on", name: str = "stack") -> tuple[Any, httpx.Client]:
    """An embedded stack (one worker) under `tmp`, and an admin client of it, warmed: the worker has
    taken a batch before the timed ones. `sandbox`: the workers' SHARDYARD_SANDBOX (on: each group
    starts fresh in its bubblewrap sandbox; off: forked from the warm trainer)."""
    from api.stack import Stack

    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    # with the sandbox off, the worker forks each group from its warm trainer (workers/warm.py)
    os.environ["SHARDYARD_WARM_TRAINER"] = "true"
    stack = Stack(root=tmp / name, workers=1, concurrency=1, extra_env={"SHARDYARD_SANDBOX": sandbox})
    (tmp / name).mkdir()
    stack.start()
    client = httpx.Client(
        base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {stack.admin_token}"}
    )
    run_rest(client, 10, "fifo")
    return stack, client


def run_search(args: argparse.Namespace) -> None:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmpdir:
        tmp = Path(tmpdir)
        stack, client = start_stack(tmp)
        ray = None  # the peer extra, needed only for the ray-optuna side
        if "ray-optuna" in args.search_sides:
            import ray

            ray.init(
                num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20
            )
        try:
            for rep in range(args.reps):
                seed = rep
                for side in args.search_sides.split(","):
                    pause_before(side, args.pause)
                    before = load()
                    if side == "rest-grid":
                        out = run_rest_search(
                            client, args.steps, method="grid", seed=seed, data_dir=stack.root
                        )
                    elif side.startswith("rest-tpe"):
                        # rest-tpe[-p<N>][-<scheduler>]: `parallel` N (else --parallel), the batch's
                        # device scheduler (else shard-lrtf)
                        m = re.fullmatch(r"rest-tpe(?:-p(\d+))?(?:-([a-z-]+))?", side)
                        if m is None:
                            raise SystemExit(f"--search-sides: {side!r} is not rest-tpe[-p<N>][-<scheduler>]")
                        out = run_rest_search(
                            client,
                            args.steps,
                            method="tpe",
                            seed=seed,
                            parallel=int(m[1]) if m[1] else args.parallel,
                            scheduler=m[2] or "shard-lrtf",
                            data_dir=stack.root,
                        )
                    else:
                        out = run_ray_optuna(args.steps, seed=seed, tmp=tmp)
                    out.update(side=side, seed=seed, rep=rep, load_before=before, load_after=load())
                    runs.append(out)
                    idle = f"  idle device-s {sum(out['idle_s']):.2f}" if out.get("idle_s") else ""
                    print(
                        f"rep {rep} {side:10s} seed {seed}: {out['wall_s']:7.2f} s  load {before:.1f}->"
                        f"{out['load_after']:.1f}{idle}",
                        flush=True,
                    )
        finally:
            client.close()
            stack.stop()
            if ray is not None:
                ray.shutdown()
    summary = summarize_search(runs)
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    print(table(summary["rows"], title=f"\nover {args.reps} seeds, interleaved"))
    for line in summary["goals"]:
        print(line)
    print(
        f"load average (1 min) around the runs: {min(loads):.2f} to {max(loads):.2f} on {os.cpu_count()} cores"
    )
    path = write_results(
        args.out if args.out != "peer" else "peer_search",
        {
            "steps": args.steps,
            "space": SPACE,
            "trials": 8,
            "parallel": args.parallel,
            "startup_trials": STARTUP,
            "runs": [{**r, "points": [list(p) for p in r["points"]]} for r in runs],
            "truth": summary["truth"],
            "summary": {k: v for k, v in summary.items() if k != "truth"},
            "load_average_1min": {"min": min(loads), "max": max(loads), "median": statistics.median(loads)},
        },
    )
    print(f"wrote {path}")


def summarize_search(runs: list[dict[str, Any]]) -> dict[str, Any]:
    grids = [r for r in runs if r["side"] == "rest-grid"]
    truth: dict[tuple[float, int], float] = {}
    for r in grids:  # every point once per repetition; training is deterministic, so they agree
        for p, v in zip(r["points"], r["values"], strict=True):
            truth.setdefault(p, v)
    best = min(truth.values())
    rows = []
    med: dict[str, float] = {}
    for side in dict.fromkeys(r["side"] for r in runs):
        rs = [r for r in runs if r["side"] == side]
        if not rs:
            continue
        for r in rs:
            r["best_after_trial"] = curve(r["points"], truth)
            r["points_run_twice"] = len(r["points"]) - len(set(r["points"]))
        med[side] = statistics.median(r["wall_s"] for r in rs)
        found = [r["best_after_trial"][-1] for r in rs]
        mean_curve = [statistics.mean(c) for c in zip(*(r["best_after_trial"] for r in rs), strict=True)]
        rows.append(
            {
                "side": side,
                "wall s (median)": med[side],
                "/ rest-grid": med[side] / med["rest-grid"] if "rest-grid" in med else "",
                "seeds": len(rs),
                "found the best": f"{sum(f == best for f in found)} of {len(rs)}",
                "best after each trial (mean over seeds)": " ".join(f"{v:.3f}" for v in mean_curve),
                "points run twice (all seeds)": sum(r["points_run_twice"] for r in rs),
                # devices with no trial to run before their group's end (REST sides)
                "idle device-s (median)": (
                    statistics.median(sum(r["idle_s"]) for r in rs)
                    if all(r.get("idle_s") for r in rs)
                    else ""
                ),
            }
        )
    goals = []
    by_side: dict[str, list[float]] = {}
    for side in [x for x in dict.fromkeys(r["side"] for r in runs) if x.startswith("rest-tpe")]:
        ratios = by_side.setdefault(side, [])
        for rep in sorted({r["rep"] for r in runs}):
            g = [r for r in runs if r["rep"] == rep and r["side"] == "rest-grid"]
            t = [r for r in runs if r["rep"] == rep and r["side"] == side]
            if g and t:
                ratios.append(t[0]["wall_s"] / g[0]["wall_s"])
        if ratios:
            goals.append(
                f"REST {side.removeprefix('rest-')} / REST grid wall, per repetition: "
                f"{', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f} (goal <= 1.05)"
            )
    ratios = by_side.get("rest-tpe", [])
    return {
        "rows": rows,
        "goals": goals,
        "tpe_over_grid": ratios,
        "over_grid_by_side": by_side,
        "best_value": best,
        "medians": med,
        "truth": [{"lr": p[0], "layers": p[1], "best_val_loss": v} for p, v in sorted(truth.items())],
    }


# -- the run ---------------------------------------------------------------------------------------


def load() -> float:
    return os.getloadavg()[0]


def pause_before(side: str, seconds: float) -> None:
    """`--pause`: wait before a REST side's batch, so that it meets its worker's spare ready."""
    if side.startswith("rest") and seconds:
        time.sleep(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sides", default="bare,executor,rest,ray,ray-reuse")
    ap.add_argument(
        "--out",
        default="peer",
        help="results file: bench/results/<out>.json; peer_search.json with --search (the default is the one current result, which is committed; another name is a scratch run for a comparison, not to be committed)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="fifo, asha or both (fifo,asha)")
    ap.add_argument(
        "--section",
        default=None,
        help="write this run as the section SECTION of bench/results/<out>.json, the file's other "
        "contents left as they are (a rerun of one comparison of the committed result)",
    )
    ap.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds to wait before each REST batch (with --search too), so that it meets its worker's spare sandboxed "
        "trainer ready, as a worker idle a while has it (workers/spare.py). 0: as the sides fall; a "
        "REST batch right after another then waits for the spare that batch's end started to finish "
        "its imports (about 2 s here)",
    )
    ap.add_argument("--search", action="store_true", help="TPE over REST beside Ray Tune's OptunaSearch")
    ap.add_argument("--search-sides", default="rest-grid,rest-tpe,ray-optuna", help="--search: the sides run")
    ap.add_argument(
        "--parallel",
        type=int,
        default=2,
        help="--search: the REST TPE batch's `parallel` (Ray's concurrency stays 2)",
    )
    args = ap.parse_args()
    if args.search:
        run_search(args)
        return
    sides = args.sides.split(",")
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: each of {', '.join(MODES)}, got {args.modes!r}")
    ts = trials(args.steps)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmpdir:
        tmp = Path(tmpdir)
        stack = client = None
        bare_stack = bare_client = None
        if "rest" in sides or "rest-nofuse" in sides:
            stack, client = start_stack(tmp)
        if "rest-unsandboxed" in sides:
            bare_stack, bare_client = start_stack(tmp, sandbox="off", name="stack-unsandboxed")
        if any(s.startswith("ray") for s in sides):
            import ray

            os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
            ray.init(
                num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20
            )
        try:
            for rep in range(args.reps):
                for side in sides:
                    for mode in modes:
                        if side == "bare" and mode == "asha":
                            continue
                        on = bare_client if side == "rest-unsandboxed" else client
                        pause_before(side, args.pause)
                        runs.append(
                            _one_run(side, mode, rep=rep, ts=ts, steps=args.steps, client=on, tmp=tmp)
                        )
        finally:
            for c in (client, bare_client):
                if c is not None:
                    c.close()
            for st in (stack, bare_stack):
                if st is not None:
                    st.stop()
            warm_groups = _warm_groups(tmp / "stack")
    summary = summarize(runs)
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    cores = os.cpu_count()
    print(table(summary["rows"], title=f"\nmedians over {args.reps} interleaved repetitions"))
    print(
        f"load average (1 min) around the runs: {min(loads):.2f} to {max(loads):.2f}, median "
        f"{statistics.median(loads):.2f}, on {cores} cores; 5/15 min at the end: "
        f"{os.getloadavg()[1]:.2f}/{os.getloadavg()[2]:.2f}"
    )
    if "rest" in sides:
        print(
            f"REST side: {warm_groups[0]} of {warm_groups[1]} worker groups ran forked from the warm trainer"
        )
    for line in summary["goals"]:
        print(line)
    payload = {
        "trials": len(ts),
        "steps": args.steps,
        "space": SPACE,
        "asha": ASHA,
        "runs": runs,
        "summary": summary,
        "load_average_1min": {"min": min(loads), "max": max(loads), "median": statistics.median(loads)},
        "rest_groups_warm": {"warm": warm_groups[0], "groups": warm_groups[1]},
    }
    path = (
        write_section(args.out, args.section, payload) if args.section else write_results(args.out, payload)
    )
    print(f"wrote {path}")


def write_section(name: str, section: str, payload: dict[str, Any]) -> Path:
    """`payload` as the section `section` of bench/results/<name>.json (which must exist), with
    the machine, the time, the commit and the command line of this run."""
    path = RESULTS / f"{name}.json"
    doc = json.loads(path.read_text())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    ).stdout.strip()
    doc[section] = {
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit,
        "command": "python -m bench.peer " + " ".join(sys.argv[1:]),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _one_run(
    side: str,
    mode: str,
    *,
    rep: int,
    ts: list[dict[str, Any]],
    steps: int,
    client: httpx.Client | None,
    tmp: Path,
) -> dict[str, Any]:
    """One side's run of the trials `ts` in one mode, with the load around it and its best trial
    (printed as it ends)."""
    before = load()
    if side == "bare":
        out = run_bare(ts)
    elif side in EXECUTOR_SIDES:
        out = run_executor(ts, mode, tmp, extra=EXECUTOR_SIDES[side])
    elif side == "executor-fused":
        out = run_executor(ts, mode, tmp, fuse=True)
    elif side == "executor-fused-host":
        out = run_executor(ts, mode, tmp, fuse=True, host=Settings(data_dir=tmp / "host"))
    elif side in ("rest", "rest-unsandboxed", "rest-nofuse"):
        assert client is not None
        out = run_rest(client, steps, mode, fuse=side != "rest-nofuse")
    else:
        out = run_ray(ts, mode, reuse=side == "ray-reuse", steps=steps, tmp=tmp)
    out.update(
        side=side,
        mode=mode,
        rep=rep,
        load_before=before,
        load_after=load(),
        best=best_of(out["trials"], {t["index"]: t["params"] for t in ts}),
    )
    b = out["best"]
    cpu = f"  {out['cpu_s']:6.2f} CPU-s" if "cpu_s" in out else ""
    print(
        f"rep {rep} {side:9s} {mode}: {out['wall_s']:7.2f} s{cpu}  best trial {b['trial']} "
        f"{b['params']} val_loss {b['val_loss']:.6f}  load {before:.1f}->{out['load_after']:.1f}",
        flush=True,
    )
    return out


def _warm_groups(stack_root: Path) -> tuple[int, int]:
    """(groups whose trainer was forked from the warm trainer, groups) in the stack's logs."""
    from trainer.zygote import WARM_MARK

    logs = list((stack_root / "selections").glob("*/group-*.stderr.log"))
    return sum(WARM_MARK in p.read_text(errors="replace") for p in logs), len(logs)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    rows = []
    bare = [r for r in runs if r["side"] == "bare"]
    floor = statistics.median(r["work_s"] for r in bare) / 2 if bare else None
    for side in dict.fromkeys(r["side"] for r in runs):
        for mode in MODES:
            rs = [r for r in runs if r["side"] == side and r["mode"] == mode]
            if not rs:
                continue
            med[side, mode] = m = statistics.median(r["wall_s"] for r in rs)
            if all("cpu_s" in r for r in rs):
                cpu[side, mode] = statistics.median(r["cpu_s"] for r in rs)
            bests = {(r["best"]["trial"], round(r["best"]["val_loss"], 6)) for r in rs}
            b = rs[0]["best"]
            rows.append(
                {
                    "side": side,
                    "mode": mode,
                    "wall s (median)": m,
                    "runs": len(rs),
                    "/ work floor": m / floor if floor else "",
                    "/ bare": m / med["bare", "fifo"] if ("bare", "fifo") in med else "",
                    "CPU-s (median)": cpu.get((side, mode), ""),
                    "/ bare CPU-s": _paired(runs, side, mode) if (side, mode) in cpu else "",
                    "best trial": b["trial"],
                    "best params": json.dumps(b["params"]),
                    "best val_loss": f"{b['val_loss']:.6f}",
                    "same best every run": len(bests) == 1,
                }
            )
    goals = []
    for side in ("executor", "executor-threads"):
        if (side, "fifo") in cpu and ("bare", "fifo") in cpu:
            goals.append(
                f"{side} CPU-s / bare CPU-s (FIFO, median of per-repetition ratios): "
                f"{_paired(runs, side, 'fifo'):.3f} (goal <= 1.05)"
            )
    if ("rest", "fifo") in med and floor:
        goals.append(f"REST warm FIFO / work floor: {med['rest', 'fifo'] / floor:.3f} (goal <= 1.05)")
    if ("rest", "fifo") in med and ("bare", "fifo") in med:
        r = med["rest", "fifo"] / med["bare", "fifo"]
        goals.append(f"REST warm / bare floor (FIFO): {r:.3f} (goal <= 1)")
    goals += _fusion_goals(runs, med, floor)
    for mode in MODES:
        if ("rest", mode) in med and ("executor", mode) in med:
            o = med["rest", mode] / med["executor", mode] - 1
            goals.append(f"service overhead over the executor ({mode}): {100 * o:+.1f}% (goal < 3%)")
        if ("rest", mode) in med and ("ray-reuse", mode) in med:
            s = med["ray-reuse", mode] / med["rest", mode]
            goals.append(f"Ray reuse_actors / Shardyard REST ({mode}): {s:.3f}x (goal >= 1.4x)")
    return {
        "rows": rows,
        "goals": goals,
        "work_floor_s": floor,
        "medians": {f"{k[0]}/{k[1]}": v for k, v in med.items()},
        "cpu_s_medians": {f"{k[0]}/{k[1]}": v for k, v in cpu.items()},
    }


def _fusion_goals(
    runs: list[dict[str, Any]], med: dict[tuple[str, str], float], floor: float | None
) -> list[str]:
    """Fusion by default against its goals: REST (fused default) over the work floor and beside Ray
    Tune, `fuse: false` over the floor, the same best trial, every curve as unfused."""
    goals = []
    for mode in MODES:
        plain = {r["rep"]: r["cpu_s"] for r in runs if r["side"] == "executor" and r["mode"] == mode}
        for side, what in (("executor-fused", "measured each run"), ("executor-fused-host", "kept per host")):
            fused = {r["rep"]: r["cpu_s"] for r in runs if r["side"] == side and r["mode"] == mode}
            ratios = [fused[k] / plain[k] for k in sorted(fused) if k in plain]
            if ratios:
                each = ", ".join(f"{x:.3f}" for x in ratios)
                goals.append(
                    f"executor fusion default ({what}) / fuse:false CPU-s ({mode}, median of "
                    f"per-repetition ratios): {statistics.median(ratios):.3f} [{each}] (goal <= 1)"
                )
    if ("rest", "fifo") in med and floor:
        goals.append(
            f"REST (fusion default) FIFO / work floor: {med['rest', 'fifo'] / floor:.3f} (goal <= 0.6)"
        )
    if ("rest-nofuse", "fifo") in med and floor:
        goals.append(
            f"REST fuse:false FIFO / work floor: {med['rest-nofuse', 'fifo'] / floor:.3f} (goal <= 1.05)"
        )
    for mode, goal, ray in (("fifo", 2.5, "ray-reuse"), ("asha", 3.0, "ray-reuse"), ("asha", 3.0, "ray")):
        if ("rest", mode) in med and (ray, mode) in med:
            goals.append(
                f"{ray} / REST fusion default ({mode}): {med[ray, mode] / med['rest', mode]:.3f}x (goal >= {goal}x)"
            )
    for mode in MODES:
        if ("rest", mode) in med and ("rest-nofuse", mode) in med:
            goals.append(
                f"REST fusion default / fuse:false ({mode}): {med['rest', mode] / med['rest-nofuse', mode]:.3f} "
                "(a default slower than no fusion is a bug: goal <= 1)"
            )
        rest = [r for r in runs if r["side"] == "rest" and r["mode"] == mode]
        off = {r["rep"]: r for r in runs if r["side"] == "rest-nofuse" and r["mode"] == mode}
        diffs = [
            max(
                (
                    abs(a - b)
                    for i, c in r["curves"].items()
                    for a, b in zip(c, off[r["rep"]]["curves"][i], strict=True)
                ),
                default=0.0,
            )
            for r in rest
            if r["rep"] in off
        ]
        if diffs:
            same_len = all(
                len(c) == len(off[r["rep"]]["curves"][i])
                for r in rest
                if r["rep"] in off
                for i, c in r["curves"].items()
            )
            goals.append(
                f"loss curves, fusion default vs fuse:false ({mode}): max |diff| {max(diffs):.2e} over every "
                f"trial and step, same lengths {same_len} (goal <= 1e-5)"
            )
        bests = {r["best"]["trial"] for r in runs if r["mode"] == mode}
        if rest:
            fused = sum(bool(t.get("fused_with")) for r in rest for t in r["trials"].values())
            goals.append(
                f"same best trial on every side ({mode}): {len(bests) == 1} ({sorted(bests)}); "
                f"trials that trained fused: {fused} of {sum(len(r['trials']) for r in rest)}"
            )
    return goals


def _paired(runs: list[dict[str, Any]], side: str, mode: str) -> float:
    """Median over repetitions of this side's CPU-seconds over the bare side's in the same
    repetition (run next to it, so under about the same load)."""
    bare = {r["rep"]: r["cpu_s"] for r in runs if r["side"] == "bare"}
    ratios = [
        r["cpu_s"] / bare[r["rep"]]
        for r in runs
        if r["side"] == side and r["mode"] == mode and r["rep"] in bare
    ]
    return statistics.median(ratios) if ratios else float("nan")


if __name__ == "__main__":
    main()
