"""The warm trainer (workers/warm.py, trainer/zygote.py) with real processes: a run forked from the
zygote trains exactly as a fresh `python -m trainer` does, its memory limit and its kill end that run
and never the zygote, a broken zygote falls back to a fresh process, and on the real stack a job
and a selection group run warm and store the metrics a fresh process computes. `checkpoints: best`
keeps one trial's directory across a batch split into two groups."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from api.stack import Stack
from core.settings import get_settings
from tests.conftest import TINY_SPEC, StackHandle, running
from trainer.zygote import SPARE_MARK, WARM_MARK
from workers import warm
from workers.execute import trainer_command
from workers.limits import GiB, out_of_memory_error
from workers.supervise import Ask, Outcome, supervise

pytestmark = pytest.mark.integration

SPEC = {**TINY_SPEC, "train": {**TINY_SPEC["train"], "steps": 6, "eval_every": 3}}


@pytest.fixture
def warm_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Turns warm runs on or off in this test process; its zygote is stopped afterwards."""

    def switch(on: bool) -> None:
        monkeypatch.setenv("SHARDYARD_WARM_TRAINER", "true" if on else "false")
        get_settings.cache_clear()

    yield switch
    warm.shutdown()
    get_settings.cache_clear()


def _supervise(
    cmd: list[str],
    tmp: Path,
    *,
    poll=None,
    memory_limit: int | None = None,  # noqa: ANN001
) -> tuple[int, Outcome, list[Any], str]:
    msgs: list[Any] = []
    out = Outcome()
    log = tmp / f"stderr-{time.monotonic_ns()}.log"
    rc = supervise(
        cmd,
        on_message=msgs.append,
        poll=(lambda: poll(msgs)) if poll else (lambda: Ask.none),
        stop_file=tmp / "stop",
        stderr_log=log,
        grace_s=10,
        shutdown_grace_s=10,
        out=out,
        memory_limit=memory_limit,
    )
    return rc, out, msgs, log.read_text() if log.exists() else ""


def _job(tmp: Path, spec: dict[str, Any], name: str) -> list[str]:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    return trainer_command(
        world_size=1, spec_path=path, ckpt_dir=tmp / f"ckpt-{name}", stop_file=tmp / "stop"
    )


def _losses(msgs: list[Any]) -> torch.Tensor:
    return torch.tensor(
        [m.value for m in msgs if m.kind == "metric" and m.name == "loss"], dtype=torch.float64
    )


def test_a_warm_run_trains_as_a_fresh_one_and_its_limit_and_kill_end_only_that_run(
    tmp_path: Path, warm_switch: Any
) -> None:
    warm_switch(False)
    rc, _, cold_msgs, cold_err = _supervise(_job(tmp_path, SPEC, "cold"), tmp_path)
    assert rc == 0 and WARM_MARK not in cold_err
    warm_switch(True)

    # a model far past 1.5 GiB of address space: the allocation fails in the run, not the zygote
    big = {**SPEC, "model": {**SPEC["model"], "d_model": 4096, "layers": 8, "heads": 8}}
    rc, out, _, err = _supervise(_job(tmp_path, big, "big"), tmp_path, memory_limit=int(1.5 * GiB))
    assert WARM_MARK in err
    assert rc != 0
    oom = out_of_memory_error(error=out.error, stderr_tail=list(out.stderr_tail), limit=int(1.5 * GiB))
    assert oom is not None and oom.startswith("out of host memory")
    zygote = warm._ZYGOTE.proc
    assert zygote is not None and warm._ZYGOTE.alive()

    # a run killed at its first step (the stop watcher's SIGKILL to its session)
    long = {**SPEC, "train": {**SPEC["train"], "steps": 100_000}}

    seen: list[str] = []

    def kill_at_first_step(msgs: list[Any]) -> Ask:
        if not any(m.kind == "metric" for m in msgs):
            return Ask.none
        seen.extend(_cmdline(p) for p in _children())
        return Ask.kill

    rc, out, _, err = _supervise(_job(tmp_path, long, "long"), tmp_path, poll=kill_at_first_step)
    assert WARM_MARK in err and rc == -signal.SIGKILL and out.stopped == "kill"
    # while it ran it was this process's child, under the command line a fresh process has
    assert any(c.startswith(f"{' '.join(_job(tmp_path, long, 'long'))}") for c in seen), seen
    pids = [p for p in _children() if "long.json" in _cmdline(p)]
    assert pids == [], "the killed run is gone"
    assert warm._ZYGOTE.proc is zygote and warm._ZYGOTE.alive(), "the zygote outlives its runs' ends"

    # the same zygote still forks, and its run computes what the fresh process did
    rc, _, warm_msgs, err = _supervise(_job(tmp_path, SPEC, "warm"), tmp_path)
    assert rc == 0 and WARM_MARK in err and f"zygote {zygote.pid} " in err
    # after its mark line, the warm run's stderr is the fresh one's (no runpy warning, say)
    assert err.splitlines()[1:] == cold_err.splitlines(), err
    assert len(_losses(cold_msgs)) == SPEC["train"]["steps"]
    torch.testing.assert_close(_losses(warm_msgs), _losses(cold_msgs), rtol=0, atol=0)
    assert [m.name for m in warm_msgs if m.kind == "metric"] == [
        m.name for m in cold_msgs if m.kind == "metric"
    ]


def test_a_zygote_that_fails_runs_the_trainer_as_a_fresh_process(
    tmp_path: Path, warm_switch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm_switch(True)
    monkeypatch.setattr(warm, "READY_TIMEOUT_S", 0.001)  # its imports cannot be done in 1 ms
    rc, _, msgs, err = _supervise(_job(tmp_path, SPEC, "fallback"), tmp_path)
    assert rc == 0 and WARM_MARK not in err and len(_losses(msgs)) == SPEC["train"]["steps"]
    assert warm._ZYGOTE.proc is None, "the failed zygote was stopped; the next run starts a new one"


def _children() -> list[int]:
    me = str(os.getpid())
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    out.append(int(d))
            except OSError:
                continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _stored_losses(stack: StackHandle, job_id: int) -> torch.Tensor:
    got = stack.client.get(f"/api/jobs/{job_id}/metrics", params={"names": "loss"}).json()
    return torch.tensor(got["series"]["loss"]["values"], dtype=torch.float64)


@pytest.fixture(scope="module")
def unsandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    """A stack whose operator turned the sandbox off: a trainer in bubblewrap starts fresh (a fork
    of the zygote cannot enter it, workers/sandbox.py), so warm runs are what an unsandboxed
    worker does."""
    st = Stack(
        root=tmp_path_factory.mktemp("warm"), workers=1, concurrency=2, extra_env={"SHARDYARD_SANDBOX": "off"}
    )
    with running(st) as handle:
        yield handle


def _grid_of_two(name: str, **extra: Any) -> dict[str, Any]:
    """A batch of two trials (two learning rates) in one group on one device, unfused: its losses
    are compared with a fresh process's to the bit, and whether a batch fuses follows a measurement
    the machine's load can tip (a fused member matches its unfused run to 1e-5, not exactly)."""
    return {
        "fuse": False,
        "name": f"{name}-batch",
        "base": {**SPEC, "name": f"{name}-sel"},
        "space": {"train.lr": [1e-3, 3e-3]},
        "method": "grid",
        "devices": 1,
        "scheduler": "fifo",
        **extra,
    }


def test_a_job_and_a_selection_group_run_warm_on_the_stack_with_the_fresh_process_metrics(
    unsandboxed: StackHandle, tmp_path: Path, warm_switch: Any
) -> None:
    stack = unsandboxed
    health = stack.client.get("/api/health").json()
    assert health["sandbox"] == "off" and health["workers"][0]["sandbox_why"] == "SHARDYARD_SANDBOX=off"
    job = stack.submit({**SPEC, "name": "warm-job"})
    sid = stack.submit_selection(_grid_of_two("warm", checkpoints="all"))["id"]
    done = stack.wait(job["id"], timeout=300)
    assert done["status"] == "succeeded", done
    sel = stack.wait_selection(sid, timeout=300)
    assert sel["status"] == "succeeded", sel

    # the worker forked both from its zygote (each run's stderr says so) ...
    job_dir = stack.stack.root / "jobs" / str(job["id"])
    assert WARM_MARK in (job_dir / "stderr.log").read_text()
    sel_dir = stack.stack.root / "selections" / str(sid)
    (group_log,) = sel_dir.glob("group-*.stderr.log")
    assert WARM_MARK in group_log.read_text()

    # ... and stored what a fresh process computes from the same spec and the same batch
    warm_switch(False)
    cmd = trainer_command(
        world_size=1, spec_path=job_dir / "spec.json", ckpt_dir=tmp_path / "job", stop_file=tmp_path / "stop"
    )
    rc, _, msgs, err = _supervise(cmd, tmp_path)
    assert rc == 0 and WARM_MARK not in err
    stored = _stored_losses(stack, job["id"])
    assert len(stored) == SPEC["train"]["steps"]
    torch.testing.assert_close(stored, _losses(msgs))

    (group_doc,) = sel_dir.glob("group-*[0-9].json")
    cold_cmd = [
        sys.executable,
        "-m",
        "trainer.selection",
        "--batch",
        str(group_doc),
        "--devices",
        "1",
        "--checkpoint-root",
        str(tmp_path / "sel"),
        "--stop-file",
        str(tmp_path / "stop"),
    ]
    rc, _, msgs, err = _supervise(cold_cmd, tmp_path)
    assert rc == 0 and WARM_MARK not in err
    for trial in sel["trials"]:
        fresh = [
            m.value for m in msgs if m.kind == "metric" and m.name == "loss" and m.trial == trial["index"]
        ]
        assert len(fresh) == SPEC["train"]["steps"]
        torch.testing.assert_close(
            _stored_losses(stack, trial["job_id"]), torch.tensor(fresh, dtype=torch.float64)
        )


def test_checkpoints_best_keeps_one_trial_across_a_batch_of_two_groups(stack: StackHandle) -> None:
    body = {
        "name": "best-of-two-groups",
        "base": {**SPEC, "name": "best2", "checkpoint_every": 3},
        "space": {"train.lr": [1e-4, 3e-3]},
        "method": "grid",
        "devices": 1,
        "group_size": 1,  # two groups, two tasks: each group's executor keeps its own trial
        "checkpoints": "best",
    }
    sid = stack.submit_selection(body)["id"]
    sel = stack.wait_selection(sid, timeout=300)
    assert sel["status"] == "succeeded", sel
    metrics = {t["index"]: t["best_metric"] for t in sel["trials"]}
    assert None not in metrics.values() and len(metrics) == 2
    best = min(metrics, key=lambda i: (metrics[i], i))
    root = stack.stack.root / "selections" / str(sid)
    assert len(list(root.glob("group-*[0-9].json"))) == 2, "the batch ran as two groups"
    # the worker removes the others before it settles the batch; a batch the reconciler happened
    # to settle first shows as ended a moment before that
    deadline = time.monotonic() + 60
    while (kept := sorted(p.name for p in root.glob("trial-*"))) != [f"trial-{best}"]:
        assert time.monotonic() < deadline, kept
        time.sleep(0.2)
    assert list((root / f"trial-{best}").glob("*.pt")), "the best trial's checkpoint is kept"


def test_a_sandboxed_job_and_group_start_from_spares_and_store_the_fresh_process_metrics(
    stack: StackHandle, tmp_path: Path, warm_switch: Any
) -> None:
    """With the sandbox on (the default), each pool process keeps a spare trainer in a sandbox of
    its own (workers/spare.py): two jobs one after the other and a batch's first group each start
    from one (their stderr says so), train what a fresh process trains, run in a sandbox (no new
    privileges, a mount namespace apart from the worker's), and leave no spare's folder behind
    but the waiting spares' own."""
    assert stack.client.get("/api/health").json()["sandbox"] == "on"
    # long enough to be seen running
    first = stack.submit({**SPEC, "name": "spare-job-1", "train": {**SPEC["train"], "steps": 600}})
    seen: dict[str, str] = {}

    def sandboxed_trainer(job: dict[str, Any]) -> bool:
        # the trainer's process, found by its command line: its status and namespaces
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if f"jobs/{job['id']}/spec.json" not in cmdline and ".spare-" not in cmdline:
                    continue
                if "-m trainer " not in cmdline + " " or "bwrap" in cmdline:
                    continue
                seen["status"] = (proc / "status").read_text()
                seen["mnt"] = os.readlink(proc / "ns" / "mnt")
                seen["limits"] = (proc / "limits").read_text()
                return True
            except OSError:
                continue
        return False

    stack.wait_until(first["id"], lambda j: j["status"] == "running" and sandboxed_trainer(j), timeout=120)
    assert stack.job(first["id"])["status"] == "running"  # (the process seen was this job's)
    assert "NoNewPrivs:\t1" in seen["status"]
    assert seen["mnt"] != os.readlink("/proc/self/ns/mnt")
    # the memory limit the spare set on itself before the job's code (workers/limits.py)
    (line,) = [ln for ln in seen["limits"].splitlines() if ln.startswith("Max address space")]
    assert line.split()[3] != "unlimited", line
    assert stack.wait(first["id"], timeout=300)["status"] == "succeeded"
    second = stack.submit({**SPEC, "name": "spare-job-2"})  # the spare replenished after the first
    sid = stack.submit_selection(_grid_of_two("spare"))["id"]
    assert stack.wait(second["id"], timeout=300)["status"] == "succeeded"
    assert stack.wait_selection(sid, timeout=300)["status"] == "succeeded"

    jobs = stack.stack.root / "jobs"
    for job in (first, second):
        assert SPARE_MARK in (jobs / str(job["id"]) / "stderr.log").read_text()
    (group_log,) = (stack.stack.root / "selections" / str(sid)).glob("group-*.stderr.log")
    assert SPARE_MARK in group_log.read_text()

    # what is left of spares: the waiting ones' folders (one per pool process), no link, no leftover
    # (the adopted spare's link goes once its run has ended, just after the status is written)
    def leftovers() -> list[str]:
        left = sorted(jobs.glob(".spare-*"))
        bad = [f"{len(left)} spares: {left}"] if len(left) > 2 else []
        for p in left:  # each holds only its empty workspace placeholder
            if not p.is_dir() or p.is_symlink():
                bad.append(f"{p}: a link or no folder")
            elif [c.name for c in p.iterdir()] != ["workspace"] or any((p / "workspace").iterdir()):
                bad.append(f"{p}: holds {[c.name for c in p.iterdir()]}")
        return bad

    deadline = time.monotonic() + 30
    while (bad := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not bad, bad

    # the stored losses are a fresh, unsandboxed process's
    warm_switch(False)
    cmd = trainer_command(
        world_size=1,
        spec_path=jobs / str(second["id"]) / "spec.json",
        ckpt_dir=tmp_path / "job",
        stop_file=tmp_path / "stop",
    )
    rc, _, msgs, err = _supervise(cmd, tmp_path)
    assert rc == 0 and SPARE_MARK not in err
    torch.testing.assert_close(_stored_losses(stack, second["id"]), _losses(msgs))
