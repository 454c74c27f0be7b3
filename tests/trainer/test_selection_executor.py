"""The executor trains each trial to exactly the parameters trainer/loop.py gives it alone, whatever
the interleaving of shards over the two CPU 'devices' (forked device processes, or worker threads),
for SGD and AdamW."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from jobrules.spec import JobSpec
from trainer.checkpoint import latest_checkpoint, load_checkpoint
from trainer.config import load_job
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run
from trainer.selection.executor import Executor, ExecutorConfig, TrialEntry
from trainer.selection.halving import HalvingConfig
from trainer.selection.policy import TrialView
from trainer.selection.shards import ShardedTrial

DATA = {"max_chars": 200_000}
SMALL = {"batch_size": 4, "eval_every": 2, "eval_batches": 1}
# a trial's optimizer state moves with its shards; the same spec run alone as a job keeps it on the
# host unless asked (its fused host optimizer rounds the last bit otherwise), so the references
# that trials are held to, bit for bit, ask for the device
ON_DEVICE = {"optimizer": "device"}
SPECS = [
    # 3 shards, AdamW
    {
        "model": {"kind": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
        "train": {"steps": 4, "lr": 1e-2, "optimizer": "adamw", "seed": 1, **SMALL},
        "parallel": {"spill": {"device_budget_mb": 64, "cuts": [1, 3], **ON_DEVICE}},
    },
    # 2 shards, SGD with momentum
    {
        "model": {"kind": "mlp", "layers": 3, "d_model": 16, "seq_len": 8},
        "train": {"steps": 5, "lr": 0.05, "optimizer": "sgd", "momentum": 0.9, "seed": 2, **SMALL},
        "parallel": {"spill": {"device_budget_mb": 64, "cuts": [2], **ON_DEVICE}},
    },
    # one shard, plain SGD
    {
        "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 8},
        "train": {"steps": 3, "lr": 0.1, "optimizer": "sgd", "seed": 3, **SMALL},
    },
    # 5 shards (one per layer), AdamW with weight decay
    {
        "model": {"kind": "mlp", "layers": 3, "d_model": 16, "seq_len": 8},
        "train": {"steps": 4, "lr": 1e-2, "weight_decay": 0.1, "seed": 4, **SMALL},
        "parallel": {"spill": {"device_budget_mb": 64, "cuts": [1, 2, 3, 4], **ON_DEVICE}},
    },
    # one shard, AdamW with gradient clipping
    {
        "model": {"kind": "mlp", "layers": 2, "d_model": 16, "seq_len": 8},
        "train": {"steps": 3, "lr": 1e-2, "grad_clip": 0.05, "seed": 5, **SMALL},
    },
    # 3 shards, SGD with momentum and gradient clipping: the global norm, then one step task a shard
    {
        "model": {"kind": "gpt", "layers": 2, "d_model": 16, "heads": 2, "seq_len": 8},
        "train": {
            "steps": 3,
            "lr": 0.1,
            "optimizer": "sgd",
            "momentum": 0.9,
            "grad_clip": 0.05,
            "seed": 6,
            **SMALL,
        },
        "parallel": {"spill": {"device_budget_mb": 64, "cuts": [1, 3], **ON_DEVICE}},
    },
]
CPU2 = [torch.device("cpu"), torch.device("cpu")]


def job(i: int) -> JobSpec:
    return load_job({"name": f"t{i}", "data": DATA, **SPECS[i]})


class RandomChoice:
    """A policy that picks any idle trial at random: arbitrary interleavings."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose(
        self, idle: Sequence[TrialView], *, active: Sequence[int], free_bytes: int | None
    ) -> TrialView | None:
        fit = [t for t in idle if free_bytes is None or t.next_shard_bytes <= free_bytes]
        return self.rng.choice(fit) if fit else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict, ListSink]]:
    out = {}
    for i in range(len(SPECS)):
        d = tmp_path_factory.mktemp(f"ref{i}")
        sink = ListSink()
        run(job(i), sink=sink, stop=NeverStop(), checkpoint_dir=d, device=torch.device("cpu"))
        out[i] = (load_checkpoint(latest_checkpoint(d))["model"], sink)
    return out


def run_batch(tmp: Path, *, scheduler: str = "shard-lrtf", custom=None, **cfg):  # noqa: ANN001, ANN003
    sinks = {i: ListSink() for i in range(len(SPECS))}
    entries = [
        TrialEntry(index=i, job=job(i), sink=sinks[i], checkpoint_dir=tmp / f"trial-{i}")
        for i in range(len(SPECS))
    ]
    cfg.setdefault("checkpoints", "all")
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(scheduler=scheduler, **cfg), policy=custom)
    results = ex.run()
    return ex, results, sinks


def check_no_overlap(ex: Executor) -> None:
    by_trial = defaultdict(list)
    for s in ex.trace:
        by_trial[s.trial].append(s)
    for slots in by_trial.values():
        slots.sort(key=lambda s: s.start)
        for a, b in zip(slots, slots[1:], strict=False):
            assert a.end <= b.start, f"trial {a.trial} ran on devices {a.device} and {b.device} at once"


@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("how", ["shard-lrtf", "round-robin", "fifo", "random-0", "random-1"])
def test_each_trial_matches_training_alone(tmp_path: Path, reference, how: str, processes: bool) -> None:  # noqa: ANN001
    custom = RandomChoice(int(how.split("-")[1])) if how.startswith("random") else None
    ex, results, sinks = run_batch(
        tmp_path, scheduler="fifo" if custom else how, custom=custom, device_processes=processes
    )
    assert ex.processes is processes
    assert {i: r["status"] for i, r in results.items()} == dict.fromkeys(range(len(SPECS)), "succeeded")
    check_no_overlap(ex)
    assert {s.device for s in ex.trace} == {0, 1}  # both devices worked
    for i, (want, ref_sink) in reference.items():
        got = load_checkpoint(latest_checkpoint(tmp_path / f"trial-{i}"))["model"]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], msg=lambda m, n=name, i=i: f"trial {i} {n}: {m}"
            )
        torch.testing.assert_close(sinks[i].series("loss"), ref_sink.series("loss"))
        torch.testing.assert_close(sinks[i].series("val_loss"), ref_sink.series("val_loss"))
        statuses = [d["status"] for e, d in sinks[i].events if e == "trial"]
        assert statuses == ["running", "succeeded"]


def test_interleavings_really_differ(tmp_path: Path) -> None:
    # the equality above means something only if the schedules interleave trials differently
    orders = []
    for seed in (0, 1):
        ex, _, _ = run_batch(tmp_path / str(seed), scheduler="fifo", custom=RandomChoice(seed))
        orders.append([(s.trial, s.kind, s.shard) for s in sorted(ex.trace, key=lambda s: s.start)])
    assert orders[0] != orders[1]


@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_budget_is_never_exceeded(tmp_path: Path, prefetch: bool, processes: bool) -> None:
    # the tightest budget every trial's cuts fit: with prefetch, twice the largest shard's working
    # set (a running shard and another trial's prefetched one); without, the largest alone
    biggest = max(
        max(ShardedTrial.build(job(i), index=i, budget_bytes=None, prefetch=False).work_bytes)
        for i in range(len(SPECS))
    )
    budget = 2 * biggest if prefetch else biggest
    ex, results, _ = run_batch(
        tmp_path, device_budget_bytes=budget, prefetch=prefetch, device_processes=processes
    )
    assert all(r["status"] == "succeeded" for r in results.values()), results
    # planned reservations and the real bytes the shards held (the strict spill ledger raises past
    # the budget, which would have failed a trial above)
    assert all(0 < lg.peak_bytes <= budget for lg in ex.reservations)
    assert all(0 < p.ledger.peak <= budget and p.ledger.strict for p in ex.places)
    assert all(p.ledger.held == 0 for p in ex.places)  # everything spilled at the end
    # double buffering across trials happened (a device reserved its next trial while running one),
    # or not at all; a CPU thread binds the shard ahead (same code path as CUDA's copy), a device
    # process only when the task comes (host and device are one memory)
    prefetched = sum(r.prefetches for r in ex.runs.values())
    assert prefetched > 0 if prefetch else prefetched == 0
    bound_ahead = sum(1 for r in results.values() if r["prefetch_s"] > 0)
    assert bound_ahead > 0 if prefetch and not processes else bound_ahead == 0


@pytest.mark.parametrize("how", ["shard-lrtf", "sequential"])
def test_asha_stops_the_right_trials(tmp_path: Path, how: str) -> None:
    # rungs at steps 1 and 2 (and 4 for the 5-step trial); reduction factor 2
    asha = HalvingConfig(reduction_factor=2, min_steps=1, mode="min")
    ex, results, sinks = run_batch(tmp_path, scheduler=how, metric="val_loss", early_stopping=asha)
    statuses = {i: r["status"] for i, r in results.items()}
    assert "stopped_early" in statuses.values() and "succeeded" in statuses.values()
    val = {i: {s: v for s, n, v in sinks[i].metrics if n == "val_loss"} for i in statuses}
    for i, st in statuses.items():
        last = results[i]["steps"]
        events = [d["status"] for e, d in sinks[i].events if e == "trial"]
        if st == "stopped_early":
            assert results[i]["stopped_early"] and last < job(i).train.steps
            assert events == ["running", "stopped_early"]
            # stopped at a rung it lost, and it says so: its rung, its value, the rung's cut-off
            stop = results[i]["stop_reason"]
            assert stop["rung"] == last and stop["value"] == val[i][last]
            assert stop["value"] >= stop["cutoff"] and stop["kept"] == max(1, stop["of"] // 2)
            final = [d for e, d in sinks[i].events if e == "trial"][-1]
            assert final["stop_reason"] == stop and sinks[i].results[-1]["stop_reason"] == stop
        else:
            assert st == "succeeded" and last == job(i).train.steps and events == ["running", "succeeded"]
    # no trial ran past a stop: each stopped trial's last task ends its last mini-batch
    for i in statuses:
        assert sum(1 for s in ex.trace if s.trial == i and s.kind == "FB") == results[i]["steps"]


def test_stop_trials_between_mini_batches(tmp_path: Path) -> None:
    ex, results, sinks = run_batch(tmp_path, scheduler="sequential")
    assert all(r["status"] == "succeeded" for r in results.values())
    # stopping trial 1 from the start: trial 0 runs, trial 1 never does
    sinks = {i: ListSink() for i in range(2)}
    entries = [TrialEntry(index=i, job=job(i), sink=sinks[i]) for i in range(2)]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(scheduler="sequential"), stop_trials=lambda: {1})
    results = ex.run()
    assert results[0]["status"] == "succeeded" and results[1]["status"] == "stopped"
    assert results[1]["steps"] == 0 and not any(s.trial == 1 for s in ex.trace)


def test_a_trial_that_cannot_be_built_fails_alone() -> None:
    bad = load_job({"data": DATA, **SPECS[0], "name": "bad"})
    bad.parallel.spill.cuts = [7]  # past the model's 4 layers
    sinks = {0: ListSink(), 1: ListSink()}
    entries = [TrialEntry(index=0, job=bad, sink=sinks[0]), TrialEntry(index=1, job=job(2), sink=sinks[1])]
    results = Executor(entries, devices=CPU2, cfg=ExecutorConfig()).run()
    assert results[0]["status"] == "failed" and "parallel.spill.cuts" in results[0]["error"]
    assert results[1]["status"] == "succeeded"
    assert [d["status"] for e, d in sinks[0].events if e == "trial"] == ["failed"]


def test_warm_start_and_checkpoint_round_trip(tmp_path: Path, reference) -> None:  # noqa: ANN001
    # warm start from trainer/loop.py's checkpoint: the trial's weights are the loop's, by name
    t = ShardedTrial.build(job(0), index=0, budget_bytes=None, prefetch=True)
    ref_dir = tmp_path / "ref"
    run(job(0), sink=ListSink(), stop=NeverStop(), checkpoint_dir=ref_dir, device=torch.device("cpu"))
    t.warm_start(ref_dir)
    want = load_checkpoint(latest_checkpoint(ref_dir))["model"]
    got = t.state()["model"]
    assert got.keys() == want.keys() and len(t.shards) == 3
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    # save and resume keep weights, optimizer state and the step
    t.step = 2
    t.save(tmp_path / "ck")
    u = ShardedTrial.build(job(0), index=0, budget_bytes=None, prefetch=True)
    assert u.resume(tmp_path / "ck") == 2
    a, b = t.state(), u.state()
    torch.testing.assert_close(a["model"], b["model"])
    torch.testing.assert_close(a["optimizer"], b["optimizer"])


class StopAfter(ListSink):
    """A sink that raises a flag once its trial reports step `step`: a stop request at a known point."""

    def __init__(self, step: int, flag: dict) -> None:
        super().__init__()
        self.step, self.flag = step, flag

    def metric(self, step: int, name: str, value: float) -> None:
        super().metric(step, name, value)
        if name == "loss" and step == self.step:
            self.flag["stop"] = True


class FlagStop:
    def __init__(self, flag: dict) -> None:
        self.flag = flag

    def requested(self) -> bool:
        return self.flag.get("stop", False)


@pytest.mark.parametrize("whole_batch", [True, False])
def test_a_stop_mid_run_ends_trials_between_mini_batches(whole_batch: bool) -> None:
    flag: dict = {}
    n = len(SPECS)
    sinks = {i: StopAfter(2, flag) if i == 0 else ListSink() for i in range(n)}
    entries = [TrialEntry(index=i, job=job(i), sink=sinks[i]) for i in range(n)]
    kw = {"stop": FlagStop(flag)} if whole_batch else {"stop_trials": lambda: {0, 1} if flag else set()}
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(scheduler="round-robin", poll_s=0.0), **kw)
    results = ex.run()
    stopped = {i for i, r in results.items() if r["status"] == "stopped"}
    assert 0 in stopped and (whole_batch or stopped <= {0, 1})
    if whole_batch:
        assert all(r["status"] in ("stopped", "succeeded") for r in results.values())
    for i, r in results.items():
        # whole mini-batches only: every step a trial counts has its loss and its last shard
        assert len(sinks[i].series("loss")) == r["steps"]
        assert sum(1 for s in ex.trace if s.trial == i and s.kind == "FB") == r["steps"]
        if r["status"] == "stopped":
            assert r["steps"] < job(i).train.steps
            assert [d["status"] for e, d in sinks[i].events if e == "trial"][-1] == "stopped"
    assert results[0]["steps"] == 2  # trial 0 stopped right after the step that raised the flag


def test_a_task_that_raises_fails_its_trial_and_frees_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ShardedTrial._compute

    def broken(self, task, s, place):  # noqa: ANN001, ANN202
        if self.index == 0 and self.step == 1 and task.kind == "B":
            raise RuntimeError("injected failure with the shard on the device")
        return real(self, task, s, place)

    monkeypatch.setattr(ShardedTrial, "_compute", broken)
    ex, results, sinks = run_batch(tmp_path, device_budget_bytes=256 * 2**20)
    assert results[0]["status"] == "failed" and "injected failure" in results[0]["error"]
    assert results[0]["steps"] == 1
    assert all(r["status"] == "succeeded" for i, r in results.items() if i != 0)
    assert [d["status"] for e, d in sinks[0].events if e == "trial"] == ["running", "failed"]
    assert all(p.ledger.held == 0 for p in ex.places)


class Jittery(Executor):
    """An executor whose device threads sleep a random while before each task: the timing of
    every rung report changes from run to run."""

    def __init__(self, *args, jitter_seed: int, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._rng = random.Random(jitter_seed)
        self._rng_lock = threading.Lock()

    def _run_task(self, d: int, run, **kw) -> None:  # noqa: ANN001, ANN003
        with self._rng_lock:
            delay = self._rng.uniform(0.0, 0.004)
        time.sleep(delay)
        super()._run_task(d, run, **kw)


@pytest.mark.parametrize("kind", ["asha", "hyperband"])
def test_rung_decisions_do_not_depend_on_timing(kind: str) -> None:
    """The same batch three times, with random delays in the device threads and a policy that
    picks at random: the same trials stop at the same rungs with the same values and cut-offs."""
    cfg = HalvingConfig(kind=kind, reduction_factor=2, min_steps=1, mode="min", seed=11)
    outcomes, orders = [], []
    for attempt in range(3):
        sinks = {i: ListSink() for i in range(len(SPECS))}
        entries = [TrialEntry(index=i, job=job(i), sink=sinks[i]) for i in range(len(SPECS))]
        ex = Jittery(
            entries,
            devices=CPU2,
            cfg=ExecutorConfig(metric="val_loss", early_stopping=cfg, checkpoints="none"),
            policy=RandomChoice(100 + attempt),
            jitter_seed=attempt,
        )
        results = ex.run()
        outcomes.append({i: (r["status"], r["steps"], r["stop_reason"]) for i, r in results.items()})
        orders.append([(s.trial, s.kind, s.shard) for s in sorted(ex.trace, key=lambda s: s.start)])
    assert outcomes[0] == outcomes[1] == outcomes[2]
    assert any(st == "stopped_early" for st, _, _ in outcomes[0].values())
    assert len({tuple(o) for o in orders}) > 1  # the runs really did interleave differently


@pytest.mark.parametrize(("policy", "kept"), [("all", 6), ("none", 0), ("best", 1)])
def test_checkpoint_policy(tmp_path: Path, policy: str, kept: int) -> None:
    ex, results, _ = run_batch(tmp_path, checkpoints=policy, metric="val_loss")
    dirs = sorted(p.name for p in tmp_path.iterdir() if latest_checkpoint(p) is not None)
    assert len(dirs) == kept
    if policy == "best":
        best = min(results.values(), key=lambda r: (r["best_metric"], r["trial"]))
        assert dirs == [f"trial-{best['trial']}"]


def test_cpu_shards_compute_in_host_memory_without_copies() -> None:
    """On a CPU "device" a shard's device copy is its host copy: nothing is copied in or out."""
    t = ShardedTrial.build(job(0), index=0, budget_bytes=None, prefetch=True)
    ex = Executor([TrialEntry(index=0, job=job(0), sink=ListSink())], devices=CPU2, cfg=ExecutorConfig())
    place = ex.places[0]
    s = t.shards[t.next_task.shard]
    t.copy_in(t.next_task.shard, place, state=True)
    assert s.dev is s.host and all(s.state_dev[k] is s.state_host[k] for k in s.state_host)
    s.spill()
    while t.step < 2:  # whole mini-batches through the aliased path, every task
        t.run_task(place)
    assert all(sh.dev is None and sh.alias for sh in t.shards)


def test_a_trial_reports_on_the_steps_a_job_does(tmp_path: Path) -> None:
    """trainer/after_step.py is the one rule set: a trial and the same job run alone report the
    same per-step metric names, evaluate on the same steps and checkpoint on the same steps; the
    last step's checkpoint is the end-of-run one, written once (the executor used to write it
    twice when the last step was a multiple of checkpoint_every)."""
    spec = {**SPECS[0], "train": {**SPECS[0]["train"], "steps": 4}, "checkpoint_every": 2}
    make = lambda: load_job({"name": "t", "data": DATA, **spec})  # noqa: E731
    alone = ListSink()
    run(make(), sink=alone, stop=NeverStop(), checkpoint_dir=tmp_path / "alone", device=torch.device("cpu"))
    trial = ListSink()
    entry = TrialEntry(index=0, job=make(), sink=trial, checkpoint_dir=tmp_path / "trial")
    results = Executor([entry], devices=CPU2, cfg=ExecutorConfig(checkpoints="all")).run()
    assert results[0]["status"] == "succeeded"

    def steps_of(sink: ListSink, name: str) -> list[int]:
        return [s for s, n, _ in sink.metrics if n == name]

    for name in ("loss", "step_time_ms", "tokens_per_s", "peak_mem_mb", "val_loss"):
        assert steps_of(trial, name) == steps_of(alone, name), name
    assert steps_of(trial, "val_loss") == [2, 4]
    saved = [d["step"] for e, d in trial.events if e == "checkpoint"]
    assert saved == [2, 4]  # step 2 by the cadence, step 4 once, at the trial's end
    assert [d["step"] for e, d in alone.events if e == "checkpoint"] == [2]  # the loop's end save is silent


def test_more_adds_a_trial_when_a_device_frees_without_waiting_for_the_others() -> None:
    """A growing batch: `more` is asked when a device frees with no trial waiting for one, its trial
    runs while the first ones still do (no generation barrier), and the run ends once it has none."""
    order: list[tuple[str, int]] = []
    queue = [2, 3]
    lock = threading.Lock()

    def more() -> list[TrialEntry]:
        with lock:
            if not queue:
                order.append(("none", -1))
                return []
            i = queue.pop(0)
            order.append(("ask", i))
            return [TrialEntry(index=i, job=job(i % 3), sink=sinks[i])]

    sinks = {i: ListSink() for i in range(4)}
    # trials 0 and 2 (one shard, 3 steps) and 3 (3 shards, 4 steps) end long before trial 1
    # (3 shards, 20 steps)
    long = load_job({"name": "long", "data": DATA, **SPECS[0], "train": {**SPECS[0]["train"], "steps": 20}})
    entries = [TrialEntry(index=0, job=job(2), sink=sinks[0]), TrialEntry(index=1, job=long, sink=sinks[1])]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(scheduler="fifo"), more=more)
    results = ex.run()
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r["status"] == "succeeded" for r in results.values())
    assert [o for o in order if o[0] == "ask"] == [("ask", 2), ("ask", 3)]
    assert order[-1] == ("none", -1)
    # trials 2 and 3 started before trial 1 ran its last task: no barrier at the first trials' end
    first = {t: min(s.start for s in ex.trace if s.trial == t) for t in results}
    last1 = max(s.end for s in ex.trace if s.trial == 1)
    assert first[2] < last1 and first[3] < last1
    # the process lives as long as the batch: ended trials hold no weights
    assert all(r.trial.shards == [] for r in ex.runs.values())


def test_more_may_add_several_trials_in_one_answer() -> None:
    """A sampler's clock may ask two trials at once (the batch's last with the one before it): both
    join from one answer, and the devices share the three trials left."""
    answers = [[2, 3]]
    asked: list[list[int]] = []
    sinks = {i: ListSink() for i in range(4)}

    def more() -> list[TrialEntry]:
        got = answers.pop(0) if answers else []
        asked.append(got)
        return [TrialEntry(index=i, job=job(2), sink=sinks[i]) for i in got]

    long = load_job({"name": "long", "data": DATA, **SPECS[0], "train": {**SPECS[0]["train"], "steps": 12}})
    entries = [TrialEntry(index=0, job=job(2), sink=sinks[0]), TrialEntry(index=1, job=long, sink=sinks[1])]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(), more=more)
    results = ex.run()
    assert sorted(results) == [0, 1, 2, 3] and all(r["status"] == "succeeded" for r in results.values())
    assert asked[0] == [2, 3] and asked[-1] == []
    first = {t: min(s.start for s in ex.trace if s.trial == t) for t in results}
    last1 = max(s.end for s in ex.trace if s.trial == 1)
    assert first[2] < last1 and first[3] < last1  # both ran beside trial 1, not after it
    assert len(ex.idle_s) == 2 and all(x >= a >= 0 for x, a in zip(ex.idle_s, ex.ask_s, strict=True))


def test_more_cannot_grow_a_batch_with_rungs() -> None:
    cfg = ExecutorConfig(early_stopping=HalvingConfig(kind="asha", reduction_factor=2, min_steps=1))
    with pytest.raises(ValueError, match="cannot have early stopping"):
        Executor([TrialEntry(index=0, job=job(2), sink=ListSink())], devices=CPU2, cfg=cfg, more=lambda: [])


# -- CPU devices as processes (trainer/selection/devices.py) --------------------------------------


def _asha_batch(**over) -> tuple[Executor, dict[int, tuple], dict[int, ListSink]]:  # noqa: ANN003
    """The SPECS batch under ASHA on CPU2 with the ExecutorConfig fields `over`: the executor after
    its run, each trial's (status, steps, stop reason, final loss), and each trial's sink."""
    asha = HalvingConfig(reduction_factor=2, min_steps=1, mode="min", seed=3)
    sinks = {i: ListSink() for i in range(len(SPECS))}
    entries = [TrialEntry(index=i, job=job(i), sink=sinks[i]) for i in range(len(SPECS))]
    cfg = ExecutorConfig(metric="val_loss", early_stopping=asha, checkpoints="none", **over)
    ex = Executor(entries, devices=CPU2, cfg=cfg)
    ends = {i: (r["status"], r["steps"], r["stop_reason"], r["final_loss"]) for i, r in ex.run().items()}
    return ex, ends, sinks


def test_device_processes_give_the_threads_results_exactly() -> None:
    """The same ASHA batch on device threads and on device processes: the same trials stop at the
    same rungs with the same values, and every trial's loss and val_loss series are bit-identical."""
    out = {}
    for processes in (False, True):
        ex, ends, sinks = _asha_batch(device_processes=processes)
        assert ex.processes is processes and {s.device for s in ex.trace} == {0, 1}
        out[processes] = (ends, {i: (sinks[i].series("loss"), sinks[i].series("val_loss")) for i in sinks})
    assert out[True] == out[False]
    assert any(st == "stopped_early" for st, _, _, _ in out[True][0].values())


def test_orders_sent_ahead_change_no_number() -> None:
    """Device processes with each next order sent as the running one ends (before it is booked)
    and without: the same trials stop at the same rungs with the same values, every series is
    bit-identical, and orders did go ahead (how many is a race with the booking: about two thirds
    on a quiet machine, under a third on a loaded one)."""
    out, ahead = {}, {}
    for send_ahead in (False, True):
        ex, ends, sinks = _asha_batch(send_ahead=send_ahead)
        assert ex.processes
        ahead[send_ahead] = (ex.orders_ahead, sum(r.orders for r in ex.runs.values()))
        out[send_ahead] = (
            ends,
            {i: (sinks[i].series("loss"), sinks[i].series("val_loss"), sinks[i].events) for i in sinks},
        )
    assert out[True] == out[False]
    assert any(st == "stopped_early" for st, _, _, _ in out[True][0].values())
    assert ahead[False][0] == 0
    sent, orders = ahead[True]
    assert 0 < sent <= orders, ahead


def test_a_trial_moves_between_device_processes_only_between_mini_batches(tmp_path: Path) -> None:
    # which device process takes a trial's next mini-batch is the processes' race: a batch on a
    # loaded machine may keep every trial where it was, so up to three batches run until one moves
    # a trial; every move of every batch must fall between mini-batches
    moved = 0
    for attempt in range(3):
        ex, results, _ = run_batch(tmp_path / str(attempt), scheduler="round-robin", device_processes=True)
        assert all(r["status"] == "succeeded" for r in results.values())
        for i in results:
            slots = sorted((s for s in ex.trace if s.trial == i), key=lambda s: s.start)
            tasks = ex.runs[i].trial.tasks
            for n, (a, b) in enumerate(zip(slots, slots[1:], strict=False)):
                if a.device != b.device:
                    moved += 1
                    assert (n + 1) % len(tasks) == 0, f"trial {i} changed device inside a mini-batch"
        if moved:
            break
    assert moved > 0  # the trials did change device (between mini-batches)


def test_a_trial_added_while_the_batch_runs_is_handed_to_the_device_processes(
    tmp_path: Path,
    reference,  # noqa: ANN001
) -> None:
    """A trial that joins after the fork is built and shared here, and adopted by the device
    process that takes it; it trains exactly as alone (the same weights as trial 0's reference)."""
    added: dict[str, object] = {}
    late_sink = ListSink()

    class AddAt(ListSink):
        def metric(self, step: int, name: str, value: float) -> None:
            super().metric(step, name, value)
            if name == "loss" and step == 1 and "run" not in added:
                entry = TrialEntry(index=9, job=job(0), sink=late_sink, checkpoint_dir=tmp_path / "trial-9")
                added["run"] = ex.add_trial(entry)

    entries = [
        TrialEntry(index=1, job=job(1), sink=AddAt()),
        TrialEntry(index=2, job=job(2), sink=ListSink()),
    ]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(checkpoints="all", device_processes=True))
    results = ex.run()
    assert results[9]["status"] == "succeeded" and results[9]["steps"] == job(0).train.steps
    assert ex.runs[9].orders > 0 and any(s.trial == 9 for s in ex.trace)
    assert ex.runs[9].released and ex.runs[9].block is None  # ended: its shared block went
    want, ref_sink = reference[0]
    got = load_checkpoint(latest_checkpoint(tmp_path / "trial-9"))["model"]
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    torch.testing.assert_close(late_sink.series("loss"), ref_sink.series("loss"))
    torch.testing.assert_close(late_sink.series("val_loss"), ref_sink.series("val_loss"))


def test_a_trial_with_a_users_data_iterable_keeps_its_device_process(tmp_path: Path) -> None:
    """The iterable's position lives in the process that drew from it: such a trial never changes
    process, and trains as alone."""
    from trainer.workspace import set_workspace

    (tmp_path / "seqdata.py").write_text(
        "import torch\n\n"
        "def batches(*, batch_size, seq_len, seed):\n"
        "    def stream(offset):\n"
        "        g = torch.Generator().manual_seed(seed + offset)\n"
        "        while True:\n"
        "            w = (torch.randint(0, 11, (batch_size, 1), generator=g) + torch.arange(seq_len + 1)) % 11\n"
        "            yield w[:, :-1], w[:, 1:]\n"
        "    return stream(0), stream(1)\n"
    )
    set_workspace(tmp_path)
    try:
        spec = {
            "name": "py",
            "model": {"kind": "gpt", "layers": 1, "d_model": 16, "heads": 2, "seq_len": 8},
            "data": {"kind": "python", "entry": "seqdata:batches", "vocab_size": 11},
            "train": {"steps": 6, "lr": 1e-2, "seed": 7, **SMALL},
        }
        alone = ListSink()
        run(load_job(spec), sink=alone, stop=NeverStop(), device=torch.device("cpu"))
        sinks = {0: ListSink(), 1: ListSink()}
        entries = [
            TrialEntry(index=0, job=load_job(spec), sink=sinks[0]),
            TrialEntry(index=1, job=job(2), sink=sinks[1]),
        ]
        ex = Executor(
            entries, devices=CPU2, cfg=ExecutorConfig(scheduler="round-robin", device_processes=True)
        )
        results = ex.run()
    finally:
        set_workspace(None)
    assert all(r["status"] == "succeeded" for r in results.values()), results
    assert len({s.device for s in ex.trace if s.trial == 0}) == 1
    torch.testing.assert_close(sinks[0].series("loss"), alone.series("loss"))
    torch.testing.assert_close(sinks[0].series("val_loss"), alone.series("val_loss"))


def _hang_in_task(monkeypatch: pytest.MonkeyPatch, marker: Path, trials: set[int]) -> None:
    """Trials `trials` write their device process's id to `marker`-<trial> at step 1's first task,
    then hang there (the forked device processes inherit the patch)."""
    real = ShardedTrial._compute

    def hanging(self, task, s, place):  # noqa: ANN001, ANN202
        if self.index in trials and self.step == 1:
            Path(f"{marker}-{self.index}").write_text(str(os.getpid()))
            time.sleep(120)
        return real(self, task, s, place)

    monkeypatch.setattr(ShardedTrial, "_compute", hanging)


def _run_with_deadline(ex: Executor, deadline_s: float = 120.0) -> dict[int, dict]:
    out: dict[str, object] = {}
    th = threading.Thread(target=lambda: out.setdefault("results", ex.run()), daemon=True)
    th.start()
    th.join(deadline_s)
    assert not th.is_alive(), "the executor hung after a device process died"
    return out["results"]  # type: ignore[return-value]


def _kill_when_written(paths: list[Path]) -> list[int]:
    """Kill each process as its id appears in one of `paths`, in the order they appear (a trial
    may wait for the device whose process hangs in another trial's task: reserved as its next)."""
    pids: list[int] = []
    left = list(paths)
    for _ in range(1200):
        for path in [p for p in left if p.exists() and p.read_text()]:
            pid = int(path.read_text())
            os.kill(pid, signal.SIGKILL)
            pids.append(pid)
            left.remove(path)
        if not left:
            break
        time.sleep(0.05)
    assert not left, f"never written: {left}"
    return pids


def test_a_device_process_killed_mid_task_fails_its_trial_and_the_batch_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hang_in_task(monkeypatch, tmp_path / "pid", {0})
    sinks = {i: ListSink() for i in range(len(SPECS))}
    entries = [TrialEntry(index=i, job=job(i), sink=sinks[i]) for i in range(len(SPECS))]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(scheduler="fifo", device_processes=True))
    killer = threading.Thread(target=lambda: killed.extend(_kill_when_written([tmp_path / "pid-0"])))
    killed: list[int] = []
    killer.start()
    results = _run_with_deadline(ex)
    killer.join()
    (pid,) = killed
    err = results[0]["error"]
    assert results[0]["status"] == "failed" and results[0]["steps"] == 1
    assert re.fullmatch(
        rf"DeviceDied: device cpu#([01]) \(process {pid}\) died: killed by signal 9 \(SIGKILL\) "
        r"while running the trial's task F0",
        err,
    ), err
    dead = int(re.search(r"cpu#([01])", err).group(1))
    assert ex.dead[dead] is not None and ex.dead[1 - dead] is None
    assert [d["status"] for e, d in sinks[0].events if e == "trial"] == ["running", "failed"]
    # a trial whose mini-batch was in the dead process fails with it (its boundary activations are
    # gone), naming the same process; every other trial runs to its end on the device left
    for i, r in results.items():
        if i != 0 and r["status"] == "failed":
            assert r["error"] == f"{err} (this trial's mini-batch was in that process)"
            assert r["steps"] < job(i).train.steps
        elif i != 0:
            assert r["status"] == "succeeded" and r["steps"] == job(i).train.steps
    assert sum(r["status"] == "succeeded" for r in results.values()) >= 3


def test_with_every_device_process_killed_the_batch_ends_failed_not_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one-shard trials: none is ever held mid-mini-batch by a process, so the third one fails only
    # because no device is left; it has steps enough to outlast the kills (alone on a device, its
    # tasks go in chunks)
    _hang_in_task(monkeypatch, tmp_path / "pid", {0, 1})
    long = {**SPECS[2], "train": {**SPECS[2]["train"], "steps": 100_000}}
    jobs = {0: job(2), 1: job(4), 2: load_job({"name": "long", "data": DATA, **long})}
    entries = [TrialEntry(index=i, job=j, sink=ListSink()) for i, j in jobs.items()]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(scheduler="round-robin", device_processes=True))
    killer = threading.Thread(target=_kill_when_written, args=([tmp_path / "pid-0", tmp_path / "pid-1"],))
    killer.start()
    results = _run_with_deadline(ex)
    killer.join()
    assert all(ex.dead)
    assert all(r["status"] == "failed" for r in results.values()), results
    for i in (0, 1):
        assert "killed by signal 9 (SIGKILL)" in results[i]["error"]
    assert 0 < results[2]["steps"] < 100_000
    assert results[2]["error"] == f"DeviceDied: no device left ({ex.dead[0]}; {ex.dead[1]})"


# -- a lone trial's tasks go to its device process in chunks; ended trials' memory goes -----------


def test_a_lone_trial_runs_in_chunks_with_the_same_results(tmp_path: Path) -> None:
    """One trial on two device processes: nothing else could use a device, so an order carries the
    tasks up to the next point where the parent acts (an evaluation, a checkpoint, the last step):
    8 steps of 5 tasks, evaluating every 4, take 2 orders instead of 40. The metrics, checkpoints,
    slots and weights are those of one task an order, and of the job run alone."""
    spec = {**SPECS[0], "train": {**SPECS[0]["train"], "steps": 8, "eval_every": 4}}
    make = lambda: load_job({"name": "t", "data": DATA, **spec})  # noqa: E731
    alone = ListSink()
    run(make(), sink=alone, stop=NeverStop(), checkpoint_dir=tmp_path / "alone", device=torch.device("cpu"))
    out = {}
    for chunk_tasks in (1, 256):
        sink = ListSink()
        entry = TrialEntry(index=0, job=make(), sink=sink, checkpoint_dir=tmp_path / f"c{chunk_tasks}")
        cfg = ExecutorConfig(checkpoints="all", device_processes=True, chunk_tasks=chunk_tasks)
        ex = Executor([entry], devices=CPU2, cfg=cfg)
        assert ex.run()[0]["status"] == "succeeded"
        slots = sorted(ex.trace, key=lambda s: s.start)
        out[chunk_tasks] = (ex.runs[0].orders, sink, [(s.kind, s.shard) for s in slots])
        check_no_overlap(ex)
    (one, one_sink, one_slots), (chunked, sink, slots) = out[1], out[256]
    assert one == 40 and chunked == 2
    assert slots == one_slots and len(slots) == 40
    for name in ("loss", "val_loss", "peak_mem_mb"):
        assert sink.series(name) == one_sink.series(name), name
        if name != "peak_mem_mb":
            assert sink.series(name) == alone.series(name), name
    assert [s for s, n, _ in sink.metrics] == [s for s, n, _ in one_sink.metrics]
    assert [d["status"] for e, d in sink.events if e == "trial"] == ["running", "succeeded"]
    want = load_checkpoint(latest_checkpoint(tmp_path / "alone"))["model"]
    for d in ("c1", "c256"):
        got = load_checkpoint(latest_checkpoint(tmp_path / d))["model"]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_a_chunks_steps_reach_the_sink_while_the_chunk_runs() -> None:
    """A chunk's steps are booked as each ends, not when the order is done: a lone trial whose one
    evaluation is at its last step runs as one chunk, yet its first steps' losses reach the sink
    before the device process has started its last step (the dashboard's progress moves; CI once saw
    a running trial stay at 0/40 until it ended). Before, every loss came after the chunk's last task.
    The margin is the whole run less a step or two: a parent thread would have to lag tens of
    steps behind its device process to fail it."""
    steps = 40
    spec = {**SPECS[0], "train": {**SPECS[0]["train"], "steps": steps, "eval_every": steps}}
    seen: list[tuple[int, float]] = []

    class Timed(ListSink):
        def metric(self, step: int, name: str, value: float) -> None:
            super().metric(step, name, value)
            if name == "loss":
                seen.append((step, time.perf_counter()))

    entry = TrialEntry(index=0, job=load_job({"name": "t", "data": DATA, **spec}), sink=Timed())
    ex = Executor([entry], devices=CPU2, cfg=ExecutorConfig(device_processes=True))
    assert ex.run()[0]["status"] == "succeeded"
    assert ex.runs[0].orders == 1  # one chunk: the whole trial
    # the first task of each step (the device's clock is the parent's: perf_counter, one machine)
    first = {}
    for n, s in enumerate(sorted(ex.trace, key=lambda s: s.start)):
        first.setdefault(n // (len(ex.trace) // steps) + 1, s.start)
    assert [st for st, _ in seen] == list(range(1, steps + 1))
    assert seen[0][1] < first[steps - 1], (seen[0][1], first[steps - 1])


def test_two_trials_on_two_devices_chunk_and_train_as_alone(tmp_path: Path, reference) -> None:  # noqa: ANN001
    """Two trials, two device processes: each device is all its trial's (neither waits for one), so
    both chunk, and each trains exactly as alone."""
    sinks = {i: ListSink() for i in (0, 1)}
    entries = [
        TrialEntry(index=i, job=job(i), sink=sinks[i], checkpoint_dir=tmp_path / f"trial-{i}") for i in (0, 1)
    ]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(checkpoints="all", device_processes=True))
    results = ex.run()
    assert all(r["status"] == "succeeded" for r in results.values())
    check_no_overlap(ex)
    tasks = {i: sum(1 for s in ex.trace if s.trial == i) for i in (0, 1)}
    assert all(ex.runs[i].orders < tasks[i] for i in (0, 1)), (tasks, [ex.runs[i].orders for i in (0, 1)])
    for i in (0, 1):
        want, ref_sink = reference[i]
        got = load_checkpoint(latest_checkpoint(tmp_path / f"trial-{i}"))["model"]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
        assert sinks[i].series("loss") == ref_sink.series("loss")
        assert sinks[i].series("val_loss") == ref_sink.series("val_loss")


@pytest.mark.parametrize("whole_batch", [True, False])
def test_a_stop_cuts_a_lone_trials_chunk_at_the_next_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_batch: bool
) -> None:
    """A lone one-task-a-step trial of 3000 steps evaluating only at its end: its orders carry 256
    tasks (steps 1-256, 257-512, 513-768, ...). From step 600 each task is slowed to 50 ms, and the
    stop comes then: the parent, which polls the stop signals while the chunk runs, cuts it at the
    next task, so the trial stops well before the chunk's end (step 768), with whole steps only."""
    import trainer.selection.devices as devices

    marker = tmp_path / "at-600"
    real = devices.execute

    def slow_after_600(t, place, *, evaluate):  # noqa: ANN001, ANN202
        if t.step >= 600:
            if t.step == 600:
                marker.write_text("1")
            time.sleep(0.05)
        return real(t, place, evaluate=evaluate)

    monkeypatch.setattr(devices, "execute", slow_after_600)  # the forked processes inherit it
    spec = {**SPECS[2], "train": {**SPECS[2]["train"], "steps": 3000, "eval_every": 3000}}
    flag: dict = {}
    sink = ListSink()
    entry = TrialEntry(index=0, job=load_job({"name": "long", "data": DATA, **spec}), sink=sink)
    kw = {"stop": FlagStop(flag)} if whole_batch else {"stop_trials": lambda: {0} if flag else set()}
    ex = Executor([entry], devices=CPU2, cfg=ExecutorConfig(device_processes=True), **kw)

    def stop_at_marker() -> None:
        for _ in range(2400):
            if marker.exists():
                break
            time.sleep(0.05)
        flag["stop"] = True

    stopper = threading.Thread(target=stop_at_marker)
    stopper.start()
    results = _run_with_deadline(ex)
    stopper.join()
    r = results[0]
    assert r["status"] == "stopped" and 600 < r["steps"] < 768, r
    assert ex.runs[0].orders == 3  # 1-256, 257-512, then the one cut short
    assert len(sink.series("loss")) == r["steps"] == sum(1 for s in ex.trace if s.trial == 0)


def _shm_maps(pid: int) -> int:
    """The shared-memory blocks process `pid` has mapped (torch's, one per trial)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/dev/shm/torch_" in line)


def test_ended_trials_shared_memory_is_unmapped_in_the_device_processes_and_here() -> None:
    """A growing batch of 10 short trials on two device processes: each ended trial's shared block is
    released here and in the device processes, so the blocks mapped stay at about the trials in
    flight however many have ended (before, every trial a process had seen stayed mapped)."""
    queue = list(range(2, 10))
    lock = threading.Lock()
    seen: list[tuple[int, int, int, int]] = []  # (trials ended, parent's, device 0's, device 1's blocks)

    class Watch(ListSink):
        def event(self, kind: str, data: dict) -> None:
            super().event(kind, data)
            if kind == "trial" and data["status"] == "running" and ex._procs is not None:
                ended = sum(r.status in ("succeeded", "failed", "stopped") for r in ex.runs.values())
                pids = [p.pid for p in ex._procs.procs]
                seen.append((ended, _shm_maps(os.getpid()), *(_shm_maps(p) for p in pids)))

    def more() -> list[TrialEntry]:
        with lock:
            if not queue:
                return []
            i = queue.pop(0)
        return [TrialEntry(index=i, job=job(i % 3), sink=Watch())]

    entries = [TrialEntry(index=i, job=job(i), sink=Watch()) for i in (0, 1)]
    ex = Executor(entries, devices=CPU2, cfg=ExecutorConfig(device_processes=True), more=more)
    base = _shm_maps(os.getpid())  # blocks other tests left here; the device processes inherit them
    results = ex.run()
    assert sorted(results) == list(range(10)) and all(r["status"] == "succeeded" for r in results.values())
    late = [s for s in seen if s[0] >= 6]
    assert late, seen
    # at most the trials in flight (two, and the one being handed over) are mapped anywhere
    assert all(max(s[1:]) - base <= 3 for s in seen), (base, seen)
    assert all(r.block is None and r.trial.shards == [] for r in ex.runs.values())


@pytest.mark.parametrize("layers", [1, 3])
def test_a_samplers_trial_cost_is_the_executors_own_estimate(layers: int) -> None:
    """core/search.py's clock costs a trial by jobrules/sizing.py trial_flops, which must be the
    executor's estimate before it measures (flops per step x steps; evaluations on top)."""
    from jobrules.sizing import trial_flops
    from jobrules.spec import JobSpec

    raw = {
        "name": "cost",
        "data": DATA,
        "model": {"kind": "gpt", "layers": layers, "d_model": 16, "heads": 2, "seq_len": 8},
        "train": {"steps": 6, "batch_size": 4, "eval_every": 3, "eval_batches": 2},
    }
    spec = JobSpec.model_validate(raw).model_dump()
    t = ShardedTrial.build(load_job(raw), index=0, budget_bytes=None, prefetch=False)
    no_evals = {**spec, "train": {**spec["train"], "eval_every": 100}}
    assert trial_flops(no_evals) == t.flops_per_step * 6
    evals = 6 // 3 * 2  # two evaluations of two batches, 2 flops per parameter per token
    assert trial_flops(spec) == pytest.approx(t.flops_per_step * 6 * (1 + 2 * evals / (8 * 6)), rel=1e-12)
