"""The worker's environment builds (workers/pyenv.py) with the real uv against the real package
index the workers use (PyPI here, reached through this machine's CA bundle), for a small real
package the project does not install (einops): built once and reused, built once by concurrent
jobs (separate processes), a tampered environment rebuilt, evicted least recently used past the
cache cap, and every failure (missing package, replacing torch, size cap, a hung index, an
unreachable one) a readable error within the limits."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.settings import Settings
from jobrules.spec import stored_job
from workers.pyenv import Report, prepare

pytestmark = pytest.mark.integration

EINOPS = stored_job({"env": {"pip": ["einops==0.8.2"]}})


class Said:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.notes: list[str | None] = []

    def report(self) -> Report:
        return Report(say=self.lines.append, note=self.notes.append)

    def text(self) -> str:
        return "\n".join(self.lines)


def imports_einops(site: Path) -> str:
    """What a fresh interpreter with the environment appended to its path (as the trainer does)
    finds for einops and torch."""
    code = (
        f"import site, sys; site.addsitedir({str(site)!r}); import einops, torch; "
        "print(einops.__version__, einops.__file__, torch.__file__)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_einops_is_not_the_projects() -> None:
    assert importlib.util.find_spec("einops") is None, "the tests need a package the project does not install"


def test_built_once_then_cached_layered_over_the_workers_torch(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    first = Said()
    env = prepare(EINOPS, settings=settings, workspace=None, report=first.report())
    env.release()
    assert env.error is None and env.path is not None
    assert first.notes == ["preparing environment", None]  # the job's status while it builds
    assert "installed einops==0.8.2" in first.text() and "uv:  + einops==0.8.2" in first.text()
    version, einops_file, torch_file = imports_einops(env.path).split()
    assert version == "0.8.2" and einops_file.startswith(str(env.path))
    assert not torch_file.startswith(str(env.path))  # torch stays the worker's
    assert not (env.path / "torch").exists()

    again = Said()
    env2 = prepare(EINOPS, settings=settings, workspace=None, report=again.report())
    env2.release()
    assert env2.path == env.path and "cached" in again.text() and "uv:" not in again.text()
    assert again.notes == [None]
    # read-only once built: a job running as another user cannot change it
    assert not (env.path / "einops" / "__init__.py").stat().st_mode & 0o222


def _built_einops(settings: Settings) -> Path:
    """einops's __init__.py in the environment built for EINOPS (released again)."""
    env = prepare(EINOPS, settings=settings, workspace=None, report=Said().report())
    env.release()
    assert env.path is not None
    return env.path / "einops" / "__init__.py"


def _rebuilt_einops(settings: Settings) -> Path:
    """einops's __init__.py in the next job's environment for EINOPS, which says it was rebuilt."""
    said = Said()
    env = prepare(EINOPS, settings=settings, workspace=None, report=said.report())
    env.release()
    assert "was changed or left incomplete since it was built: rebuilt" in said.text()
    assert env.path is not None
    return env.path / "einops" / "__init__.py"


def test_a_tampered_environment_is_rebuilt_for_the_next_job(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    target = _built_einops(settings)
    original = target.read_text()
    target.chmod(0o644)  # root ignores the mode; a job running as root could write anyway
    target.write_text("raise ImportError('tampered')\n")
    assert _rebuilt_einops(settings).read_text() == original


def test_a_forged_environment_is_rebuilt_even_with_its_size_mode_and_times_restored(tmp_path: Path) -> None:
    # what a job running as the worker's uid could do before the sandbox: plant code in a cached
    # environment and put back every stat field the old fingerprint read; the content hash sees it
    settings = Settings(data_dir=tmp_path)
    target = _built_einops(settings)
    original, st = target.read_bytes(), target.stat()
    forged = b"import os  # planted" + b" " * max(0, len(original) - 21)
    forged = forged[: len(original)].ljust(len(original), b" ")
    assert len(forged) == len(original) and forged != original
    target.chmod(0o644)
    target.write_bytes(forged)
    target.chmod(st.st_mode)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(target.parent, ns=(target.parent.stat().st_atime_ns, target.parent.stat().st_mtime_ns))
    assert _rebuilt_einops(settings).read_bytes() == original


def _prepare_in_process(data_dir: str, start: float, q) -> None:  # noqa: ANN001
    while time.time() < start:
        time.sleep(0.005)
    said = Said()
    env = prepare(EINOPS, settings=Settings(data_dir=Path(data_dir)), workspace=None, report=said.report())
    q.put((str(env.path), env.error, said.text()))
    env.release()


def test_concurrent_jobs_build_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    start = time.time() + 3.0  # all three start together, after their interpreters are up
    procs = [ctx.Process(target=_prepare_in_process, args=(str(tmp_path), start, q)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert {e for _, e, _ in got} == {None}
    assert len({path for path, _, _ in got}) == 1
    builds = [text for _, _, text in got if "ready in" in text]
    assert len(builds) == 1, [t for _, _, t in got]
    assert len(list((tmp_path / "envs").glob(".tmp-*"))) == 0


def test_least_recently_used_is_evicted_past_the_cap_but_not_one_in_use(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, pyenv_cache_mb=0.3)  # one einops environment (~0.2 MiB) fits
    a = prepare(
        stored_job({"env": {"pip": ["einops==0.8.2"]}}),
        settings=settings,
        workspace=None,
        report=Said().report(),
    )
    held = prepare(
        stored_job({"env": {"pip": ["einops==0.8.1"]}}),
        settings=settings,
        workspace=None,
        report=Said().report(),
    )
    # `a` is still held by its job: nothing could be evicted to make room
    assert a.path is not None and a.path.is_dir() and held.path is not None and held.path.is_dir()
    a.release()
    c = prepare(
        stored_job({"env": {"pip": ["einops==0.8.0"]}}),
        settings=settings,
        workspace=None,
        report=Said().report(),
    )
    held.release()
    c.release()
    assert not a.path.exists()  # the least recently used one nobody held
    assert held.path.is_dir() and c.path is not None and c.path.is_dir()


def test_a_missing_package_fails_fast_naming_it(tmp_path: Path) -> None:
    said = Said()
    t0 = time.monotonic()
    env = prepare(
        stored_job({"env": {"pip": ["shardyard-no-such-package-zzq==1.0"]}}),
        settings=Settings(data_dir=tmp_path),
        workspace=None,
        report=said.report(),
    )
    assert env.path is None and env.error is not None
    assert "shardyard-no-such-package-zzq" in env.error and "not found" in env.error
    assert time.monotonic() - t0 < 120  # bounded (the build limit is 600 s), never stuck
    assert said.notes[-1] is None  # the status note is cleared


def test_a_dependency_that_needs_another_torch_fails_with_the_reason(tmp_path: Path) -> None:
    # the spec alone cannot tell: torchvision 0.20 needs torch 2.5.0, the worker runs 2.13
    env = prepare(
        stored_job({"env": {"pip": ["torchvision==0.20.0"]}}),
        settings=Settings(data_dir=tmp_path),
        workspace=None,
        report=Said().report(),
    )
    assert env.error is not None and "torch" in env.error and "unsatisfiable" in env.error


def test_size_cap_fails_with_the_numbers(tmp_path: Path) -> None:
    env = prepare(
        EINOPS,
        settings=Settings(data_dir=tmp_path, pyenv_max_mb=0.01),
        workspace=None,
        report=Said().report(),
    )
    assert env.error is not None and "MiB, more than the 0 MiB allowed" in env.error
    assert not [p for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".") and p.is_dir()]


def test_a_hung_index_hits_the_build_time_limit(tmp_path: Path) -> None:
    with socket.socket() as hung:  # accepts connections, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/simple"
        settings = Settings(data_dir=tmp_path, pyenv_index_url=url, pyenv_build_timeout_s=4)
        t0 = time.monotonic()
        env = prepare(
            stored_job({"env": {"pip": ["shardyard-hung-zzq"]}}),
            settings=settings,
            workspace=None,
            report=Said().report(),
        )
    assert env.error is not None and "longer than the 4 s limit" in env.error
    assert time.monotonic() - t0 < 60


def test_an_unreachable_index_fails_naming_it(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: connections are refused
    settings = Settings(data_dir=tmp_path, pyenv_index_url=f"http://127.0.0.1:{port}/simple")
    env = prepare(
        stored_job({"env": {"pip": ["einops==0.8.2"]}}),
        settings=settings,
        workspace=None,
        report=Said().report(),
    )
    assert env.error is not None and f"127.0.0.1:{port}" in env.error


def test_a_local_wheelhouse_without_an_index(tmp_path: Path) -> None:
    house = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(house), "einops==0.8.2"],
        check=True,
    )
    settings = Settings(data_dir=tmp_path, pyenv_find_links=str(house), pyenv_no_index=True)
    said = Said()
    env = prepare(EINOPS, settings=settings, workspace=None, report=said.report())
    env.release()
    assert env.error is None and "installed einops==0.8.2" in said.text()


def test_options_are_refused_unless_an_admin_allows_them(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "requirements.txt").write_text("--extra-index-url https://pypi.org/simple\neinops==0.8.2\n")
    refused = prepare(
        stored_job({}), settings=Settings(data_dir=tmp_path), workspace=ws, report=Said().report()
    )
    assert refused.error is not None and "requirements.txt line 1" in refused.error
    assert "pip option (--extra-index-url)" in refused.error
    said = Said()
    allowed = prepare(
        stored_job({}),
        settings=Settings(data_dir=tmp_path, pyenv_allow_options=True),
        workspace=ws,
        report=said.report(),
    )
    allowed.release()
    assert allowed.error is None and "installed einops==0.8.2" in said.text()
