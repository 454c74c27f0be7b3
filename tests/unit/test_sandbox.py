"""The sandbox's rules (workers/sandbox.py) on real processes: what a trainer inherits, what it
sees of the file system in a real bubblewrap sandbox, and the refusal where none can be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.settings import Settings
from workers import spare as spare_module
from workers.sandbox import Sandbox, SandboxUnavailable, allowed_environment, describe, probe
from workers.spare import Spare

SECRETS = {
    "SHARDYARD_DATABASE_URL": "postgresql://api:pw@db/shardyard",
    "SHARDYARD_BROKER_URL": "redis://:hunter2@127.0.0.1:6379/0",
    "SHARDYARD_ADMIN_TOKEN": "sy_admin",
    "SHARDYARD_BROKER_SIGNING_KEY": "k",
    "AWS_ACCESS_KEY_ID": "AKIA",
    "AWS_SECRET_ACCESS_KEY": "s3cret",
    "HTTPS_PROXY": "http://user:pw@proxy:3128",
}


def test_a_trainer_inherits_no_credential() -> None:
    base = {**SECRETS, "PATH": "/usr/bin", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "1"}
    env = allowed_environment(base)
    assert env["OMP_NUM_THREADS"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "1" and env["PATH"] == "/usr/bin"
    assert not set(SECRETS) & set(env)
    # an environment build also gets the way to the index (a proxy), and still no service secret
    build = allowed_environment(base, build=True)
    assert build["HTTPS_PROXY"] and not (set(SECRETS) - {"HTTPS_PROXY"}) & set(build)


def _in_sandbox(sandbox: Sandbox, code: str) -> subprocess.CompletedProcess[str]:
    cmd = sandbox.command([sys.executable, "-c", code])
    return subprocess.run(cmd, env=sandbox.environment(), capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(probe() is not None, reason=f"bubblewrap cannot run here: {probe()}")
def test_the_sandbox_shows_its_own_folder_and_hides_the_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    mine, other = data / "jobs" / "1", data / "jobs" / "2"
    for d in (mine, other):
        d.mkdir(parents=True)
        (d / "spec.json").write_text("{}")
    (data / "shardyard.db").write_text("db")
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'shardyard.db'}")
    sandbox = Sandbox(settings=settings, read_write=[mine], read_only=[])
    code = (
        "import os, pathlib, json\n"
        f"print(json.dumps({{'jobs': sorted(os.listdir({str(data / 'jobs')!r})),"
        f" 'db': os.path.exists({str(data / 'shardyard.db')!r}),"
        f" 'uid': os.getuid(), 'procs': sum(d.isdigit() for d in os.listdir('/proc'))}}))\n"
        f"pathlib.Path({str(mine / 'out.txt')!r}).write_text('ok')\n"
    )
    done = _in_sandbox(sandbox, code)
    assert done.returncode == 0, done.stderr
    seen = __import__("json").loads(done.stdout)
    assert seen["jobs"] == ["1"] and seen["db"] is False
    assert seen["uid"] == 10001
    assert seen["procs"] <= 3  # its own PID namespace: bubblewrap's init and itself
    assert (mine / "out.txt").read_text() == "ok"  # its own folder is writable


@pytest.mark.skipif(probe() is not None, reason=f"bubblewrap cannot run here: {probe()}")
def test_the_workspace_and_the_code_are_read_only_and_there_is_no_network(tmp_path: Path) -> None:
    job = tmp_path / "jobs" / "3"
    ws = job / "workspace"
    ws.mkdir(parents=True)
    settings = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'x.db'}")
    sandbox = Sandbox(settings=settings, read_write=[job], read_only=[ws])
    code_dir = Path(__file__).resolve().parents[2] / "trainer"
    code = (
        "import socket, pathlib\n"
        "out = []\n"
        f"for p in ({str(ws / 'x.py')!r}, {str(code_dir / 'x.py')!r}):\n"
        "    try:\n"
        "        pathlib.Path(p).write_text('x'); out.append('wrote ' + p)\n"
        "    except OSError as e:\n"
        "        out.append(type(e).__name__)\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2); out.append('net')\n"
        "except OSError as e:\n"
        "    out.append('no network')\n"
        "print(out)\n"
    )
    done = _in_sandbox(sandbox, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['OSError', 'OSError', 'no network']"
    assert not (ws / "x.py").exists() and not (code_dir / "x.py").exists()


def test_a_worker_that_cannot_sandbox_refuses_users_code_only(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, sandbox_bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="SHARDYARD_SANDBOX=off"):
        Sandbox(settings=settings, read_write=[tmp_path], user_code=True).check()
    Sandbox(settings=settings, read_write=[tmp_path], user_code=False).check()  # built-in: runs
    assert describe(settings)["sandbox"] == "unavailable"
    off = Settings(data_dir=tmp_path, sandbox="off", sandbox_bwrap="/nonexistent/bwrap")
    Sandbox(settings=off, read_write=[tmp_path], user_code=True).check()
    assert describe(off) == {"sandbox": "off", "why": "SHARDYARD_SANDBOX=off"}


@pytest.mark.skipif(probe() is not None, reason=f"bubblewrap cannot run here: {probe()}")
def test_the_hardware_sampler_finds_the_trainer_below_bubblewrap(tmp_path: Path) -> None:
    # the process group a worker supervises is led by bwrap: rank 0's samples must be the
    # trainer's own (a bwrap process holds ~2 MB), found past bubblewrap's processes
    from workers.hardware import group_ranks
    from workers.sandbox import die_with_parent

    settings = Settings(data_dir=tmp_path / "data")
    sandbox = Sandbox(settings=settings, read_write=[tmp_path])
    code = "import time, torch; print('up', flush=True); time.sleep(30)"
    cmd = sandbox.command([sys.executable, "-c", code])
    proc = subprocess.Popen(
        cmd, env=sandbox.environment(), stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        (rank0,) = group_ranks(proc.pid).values()
        assert rank0 != proc.pid
        cmdline = Path(f"/proc/{rank0}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0] == sys.executable.encode() and b"import time, torch" in cmdline[2]
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(probe() is not None, reason=f"bubblewrap cannot run here: {probe()}")
def test_a_spare_is_sandboxed_as_a_cold_run_is_and_becomes_nothing_but_a_trainer(tmp_path: Path) -> None:
    """The spare trainer made ahead (workers/spare.py) runs in the very sandbox a cold run of its
    folder gets, its workspace placeholder read-only, and refuses to become anything but
    `python -m trainer[.selection]`."""
    data = tmp_path / "data"
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'shardyard.db'}")
    spare = Spare(settings)
    try:
        cold = Sandbox(
            settings=settings, read_write=[spare.inside], read_only=[spare.inside / "workspace"]
        ).command([sys.executable, "-m", "trainer.zygote", "--spare"])
        assert spare.proc.args == cold
        assert spare.wait_ready(120)
        job = data / "jobs" / "4"
        job.mkdir()
        (job / "spec.json").write_text("{}")
        spare.adopt(job, move_existing=True)
        assert (job / "spec.json").is_file() and spare.inside.resolve() == job.resolve()
        assert spare.misfit([sys.executable, "-c", "print(1)"], Sandbox(settings=settings, read_write=[job]))
        proc = spare.start([sys.executable, "-c", "open('/tmp/x','w')"], env={}, memory_limit=None)
        assert proc.wait(timeout=60) == 1
        assert proc.stderr is not None and "cannot run" in (err := proc.stderr.read()), err
    finally:
        spare.discard()


def test_the_next_spare_starts_at_once_only_where_the_run_leaves_the_cores_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings.spare_ahead: auto starts the next spare when a run took the last one only for a
    run on a GPU (it holds GPUs, or asks for any device on a host with GPU device nodes); a CPU
    run's threads use every core, so its spare waits for the run's end."""
    nodes = tmp_path / "dev"
    nodes.mkdir()
    monkeypatch.setattr(spare_module, "GPU_NODES", str(nodes / "nvidia[0-9]*"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def settings(mode: str) -> Settings:
        return Settings(data_dir=tmp_path, spare_ahead=mode)

    auto = settings("auto")
    assert spare_module.ahead(auto, gpus=1, device="cuda")
    assert spare_module.ahead(auto, gpus=1, device="auto")
    assert not spare_module.ahead(auto, gpus=0, device="cpu")
    assert not spare_module.ahead(auto, gpus=0, device="auto")  # no GPU on this host
    (nodes / "nvidiactl").touch()  # the driver's control node is no GPU
    assert not spare_module.ahead(auto, gpus=0, device="auto")
    (nodes / "nvidia0").touch()
    assert spare_module.ahead(auto, gpus=0, device="auto")
    assert not spare_module.ahead(auto, gpus=0, device="cpu")  # a run on the CPU, GPU or not
    for hidden in ("", "-1", "-1,0"):  # a worker shown no GPU runs on the CPU
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not spare_module.ahead(auto, gpus=0, device="auto"), hidden
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert spare_module.ahead(auto, gpus=0, device="auto")
    assert spare_module.ahead(settings("always"), gpus=0, device="cpu")
    assert not spare_module.ahead(settings("never"), gpus=2, device="cuda")


@pytest.mark.skipif(probe() is not None, reason=f"bubblewrap cannot run here: {probe()}")
def test_a_spare_taken_with_start_next_leaves_a_ready_one_for_the_next_run(tmp_path: Path) -> None:
    """A run that takes its pool process's spare with `start_next` has the next one started at
    once, a sandbox and imports of its own, ready while the first is still the run's; the run's
    end keeps that one rather than starting a third. Without `start_next` the pool holds none
    until the run's end (the CPU run's rule)."""
    data = tmp_path / "data"
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'shardyard.db'}")
    assert spare_module.prestart(settings)
    try:
        first = spare_module._POOL.spare
        assert first is not None
        used = spare_module.take(settings, data / "jobs" / "1", fits=True, start_next=True)
        assert used is first and used.adopted == data / "jobs" / "1"
        following = spare_module._POOL.spare
        assert following is not None and following is not first and following.adopted is None
        assert following.inside.is_dir() and following.inside != first.inside
        assert following.wait_ready(120) and first.alive()
        spare_module.replenish(settings, used)
        assert spare_module._POOL.spare is following and following.alive()

        again = spare_module.take(settings, data / "jobs" / "2", fits=True)
        assert again is following and spare_module._POOL.spare is None
        spare_module.replenish(settings, again)
        assert spare_module._POOL.spare is not None and spare_module._POOL.spare is not following
        assert not following.alive()  # adopted, never started: discarded at the run's end
    finally:
        spare_module.shutdown()
    assert sorted(p.name for p in (data / "jobs").iterdir()) == ["1", "2"]


@pytest.mark.skipif(probe() is not None, reason=f"bubblewrap cannot run here: {probe()}")
def test_a_spare_taken_the_moment_it_was_started_is_adopted_once_its_sandbox_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job right after another takes the spare that run's end started a moment ago. Its folder
    is renamed to the job's only once bubblewrap has bound it (the spare's started line): renamed
    before, bubblewrap found no source to bind and the spare died, and the job started cold. A
    spare that dies says why (its exit code and stderr). A bubblewrap that takes a second to start
    (a loaded host's) makes sure the take comes before the sandbox is made."""
    bound_at_adopt: list[bool] = []
    adopt = Spare.adopt

    def watched(self: Spare, folder: Path, *, move_existing: bool) -> None:
        bound_at_adopt.append(self._lines_seen >= 1)  # its started line read: the sandbox is made
        adopt(self, folder, move_existing=move_existing)

    monkeypatch.setattr(Spare, "adopt", watched)
    slow = tmp_path / "slow-bwrap"
    slow.write_text(f'#!/bin/sh\nsleep 1\nexec {shutil.which("bwrap")} "$@"\n')
    slow.chmod(0o755)
    data = tmp_path / "data"
    settings = Settings(
        data_dir=data, database_url=f"sqlite:///{data / 'shardyard.db'}", sandbox_bwrap=str(slow)
    )
    used = None
    assert spare_module.prestart(settings)
    try:
        used = spare_module.take(settings, data / "jobs" / "7", fits=True)  # no wait before
        assert used is not None and used.adopted == data / "jobs" / "7"
        assert bound_at_adopt == [True]
        assert used.wait_ready(120), used.why_not
        assert used.alive()
    finally:
        spare_module.shutdown()
        if used is not None:
            used.discard()
    broken = Spare(settings)
    broken.inside.rename(broken.inside.with_name("elsewhere"))  # what the early rename did
    try:
        assert not broken.wait_ready(120)
        assert "exited with code" in broken.why_not and "bwrap" in broken.why_not, broken.why_not
    finally:
        broken.discard()
