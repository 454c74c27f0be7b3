"""The sandbox one attempt's trainer runs in: what users' code may see, reach and inherit.

Users' code (a workspace's model and data source, the packages its requirements install) is
trusted with nothing. Every trainer process a worker starts gets:

- **an allow-listed environment** (`environment`): the variables the trainer, torch and torchrun
  need, by name, and nothing of the worker's own (no database or broker URL, no password, token
  or cloud key). The worker keeps those: it talks to the database, the broker and the store on
  the attempt's behalf (workers/relay.py, workers/ckpt_sync.py).
- **a bubblewrap sandbox** (`command`, Debian's `bwrap`, what Flatpak builds on): its own user,
  PID, mount, IPC, UTS and cgroup namespaces, and its own network namespace with only a loopback
  (a one-node job; a gang's ranks share the host's network to reach each other's rendezvous and
  collective ports). Inside it, uid 10001 with no capabilities and no new privileges; the system,
  the Python installation, the project's code and its virtual environment read-only; the job's
  workspace and environment read-only; the job's own folder read-write; a private /tmp and /dev;
  a /proc of its own. Nothing else of the data dir (no database file, no store, no other job) and
  nothing of the home folders or /etc's secrets exists in it.

`SHARDYARD_SANDBOX=off` (an operator's choice, shown by the health route and the dashboard) runs
the trainer without bubblewrap, still with the allow-listed environment. Where the sandbox cannot
be made (no bwrap, no user namespaces, a container without the rights) and it is not off, a job
with users' code is refused with the reason (`unavailable`); a job of built-in models and data
runs no users' code and needs none (docs/security.md says why).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.settings import Settings
from workers.cores import run_share

log = logging.getLogger(__name__)

SANDBOX_UID = 10001
"""The uid (and gid) users' code runs as inside the sandbox: the image's own unprivileged user."""

PASSED_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TERM",
    # thread counts and what torch reads of its own
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TORCH_NUM_THREADS",
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_CPP_LOG_LEVEL",
    "LOGLEVEL",  # torchrun's own log level
    # the devices the worker was given
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    # the trainer's own knobs (trainer/checkpoint.py; jobrules/pyenv.py)
    "SHARDYARD_CHECKPOINT_KEEP",
    "SHARDYARD_PYENV_ALLOW_OPTIONS",
    # where the operator installed the project's code (read-only in the sandbox, code_roots)
    "PYTHONPATH",
    # where the machine's certificate authorities are (paths, no secret)
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
)

BUILD_ENV = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "UV_INDEX_URL",
    "UV_DEFAULT_INDEX",
    "UV_EXTRA_INDEX_URL",
    "UV_FIND_LINKS",
    "UV_NATIVE_TLS",
)
"""What an environment build (workers/pyenv.py) inherits besides PASSED_ENV: the way to the
package index the operator set up. A source distribution runs code while it builds, so an index
URL with a password in it reaches that code (docs/security.md)."""
"""The worker's variables a trainer process inherits, by name; every other one stays behind.
(A variable that only names a thread count or a device can carry no credential.)"""

# the files of /etc a Python process needs; /etc as a whole holds the host's secrets (shadow,
# ssh host keys, the operator's own files)
_ETC = (
    "passwd",
    "group",
    "hosts",
    "nsswitch.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "ssl",
    "ca-certificates",
    "alternatives",
    "mime.types",
)
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/opt/conda")


def allowed_environment(
    base: dict[str, str] | os._Environ[str] | None = None, *, build: bool = False
) -> dict[str, str]:
    """The allow-listed variables of `base` (the worker's own environment by default); `build`:
    an environment build's, with BUILD_ENV too."""
    base = os.environ if base is None else base
    names = PASSED_ENV + BUILD_ENV if build else PASSED_ENV
    env = {k: base[k] for k in names if k in base}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def die_with_parent() -> None:
    """In the child before exec: own session (so a stop can kill torchrun and its ranks as one
    group), and SIGKILL when the worker process that launched it dies (Linux), so a killed worker
    never leaves a trainer running unsupervised; its job's lease then runs out."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def sandbox_limits(sandbox: Sandbox | None) -> dict[int, int]:
    """The resource limits of a trainer process (besides its memory: workers/limits.py)."""
    if sandbox is None or not sandbox.enabled:
        return {}
    return {
        resource.RLIMIT_NOFILE: sandbox.settings.sandbox_nofile,
        resource.RLIMIT_NPROC: sandbox.settings.sandbox_nproc,
        resource.RLIMIT_CORE: 0,
    }


def apply_limits(limits: dict[int, int]) -> None:
    """In the child before exec: each limit, soft and hard, never above the hard one it has."""
    for what, value in limits.items():
        _soft, hard = resource.getrlimit(what)
        top = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(what, (top, top))


class SandboxUnavailable(Exception):
    """The sandbox cannot be made on this worker (the message says why)."""


@functools.cache
def probe(bwrap: str | None = None) -> str | None:
    """Why bubblewrap cannot make a sandbox here, or None when it can (tried once per process:
    a real sandbox running /bin/true with the namespaces `command` asks for)."""
    exe = bwrap or shutil.which("bwrap")
    if exe is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        r = subprocess.run(
            [
                exe,
                *_namespaces(network=False),
                "--ro-bind",
                "/",
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap could not run: {e}"
    if r.returncode != 0:
        return f"bubblewrap cannot make a sandbox here: {r.stderr.strip()[-300:]}"
    return None


def _namespaces(*, network: bool) -> list[str]:
    ns = [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--cap-drop",
        "ALL",
        "--die-with-parent",
    ]
    if not network:
        ns.append("--unshare-net")  # a loopback of its own is up: enough for torchrun --standalone
    return ns


def code_roots() -> list[Path]:
    """The Python installation, the virtual environment and the project's code: what the
    trainer imports (read-only in the sandbox)."""
    project = Path(__file__).resolve().parents[1]
    roots = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), project}
    return sorted(roots)


@dataclass(kw_only=True)
class Sandbox:
    """One attempt's sandbox: its own folder read-write, its workspace and environment read-only."""

    settings: Settings
    read_write: list[Path]
    """The attempt's folder (a job's, or a selection's): its spec, checkpoints and stop file."""
    read_only: list[Path] = field(default_factory=list)
    """Its unpacked workspace and its environment (workers/pyenv.py)."""
    network: bool = False
    """A gang's node: its ranks reach the other nodes' (the host's network, no credentials)."""
    user_code: bool = True
    """The spec runs users' code (a workspace, requirements, a data source of its own)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables of the attempt's own (e.g. HOME), on top of the allow-listed ones."""

    @property
    def enabled(self) -> bool:
        return self.settings.sandbox != "off"

    def check(self) -> None:
        """Raise SandboxUnavailable when this attempt needs a sandbox that cannot be made here."""
        if not self.enabled or not self.user_code:
            return
        if why := probe(self.settings.sandbox_bwrap or None):
            raise SandboxUnavailable(
                f"this worker cannot sandbox users' code ({why}); its operator may run it unsandboxed "
                "with SHARDYARD_SANDBOX=off"
            )

    @property
    def wraps(self) -> bool:
        """Whether `command` puts the trainer in bubblewrap (else it runs as the worker's child)."""
        return self.enabled and probe(self.settings.sandbox_bwrap or None) is None

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The trainer's environment: the allow-listed variables of `base` (the worker's own),
        then the attempt's."""
        env = allowed_environment(base)
        home = str(self.read_write[0]) if self.read_write else "/tmp"
        env.update({"HOME": home, "PYTHONDONTWRITEBYTECODE": "1"})
        if self.wraps:
            env["TMPDIR"] = "/tmp"
        if self.settings.trainer_nice:
            env["SHARDYARD_TRAINER_NICE"] = str(self.settings.trainer_nice)  # trainer/priority.py
        if (share := run_share(self.settings)) is not None:  # a worker running several jobs at once
            env["SHARDYARD_TRAINER_CORES"] = str(share)  # trainer/priority.py use_cores
        env.update(self.env)
        return env

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` inside bubblewrap (unchanged when the sandbox is off or not needed and not made)."""
        if not self.wraps:
            return cmd
        exe = self.settings.sandbox_bwrap or shutil.which("bwrap") or "bwrap"
        args: list[str] = [exe, *_namespaces(network=self.network)]
        # the private mounts first: a folder bound below (a job's, in a /tmp of the host) stays
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm"]
        for p in _SYSTEM:
            if os.path.lexists(p):
                args += ["--ro-bind", p, p] if not os.path.islink(p) else ["--symlink", os.readlink(p), p]
        for name in _ETC:
            p = f"/etc/{name}"
            if os.path.exists(p):
                args += ["--ro-bind", p, p]
        for p in code_roots():
            args += ["--ro-bind", str(p), str(p)]
        # whatever of the service lies below the code (the embedded default's data dir sits in the
        # project's folder) is hidden before the attempt's own folders are bound back in
        for p in self._hidden():
            args += ["--tmpfs", str(p)]
        for p in self.read_write:
            p.mkdir(parents=True, exist_ok=True)
            args += ["--bind", str(p), str(p)]
        # after the read-write folders: a workspace unpacked inside the job's folder stays read-only
        for p in [*self.read_only, *self.settings.sandbox_paths]:
            if p.exists():
                args += ["--ro-bind", str(p), str(p)]
        for dev in _gpu_devices():
            args += ["--dev-bind", dev, dev]
        args += ["--chdir", str(self.read_write[0]) if self.read_write else "/tmp"]
        return [*args, "--", *cmd]

    def _hidden(self) -> list[Path]:
        """The service's own places that may lie inside a read-only bind: the data dir, the
        SQLite database's folder, a folder store, the environment cache."""
        places = {self.settings.data_dir.resolve(), self.settings.pyenv_root.resolve()}
        url = self.settings.database_url
        if url.startswith("sqlite:///"):
            places.add(Path(url.removeprefix("sqlite:///")).resolve().parent)
        store = self.settings.storage_url
        if store.startswith("file://"):
            places.add(Path(store.removeprefix("file://")).resolve())
        elif store and "://" not in store:
            places.add(Path(store).resolve())
        roots = code_roots()
        return sorted(p for p in places if any(p.is_relative_to(r) for r in roots) and p.is_dir())


def _gpu_devices() -> list[str]:
    """The NVIDIA device files of this host (none without a GPU): bound into the sandbox so CUDA
    works there (CUDA_VISIBLE_DEVICES still picks the devices)."""
    dev = Path("/dev")
    found = [str(p) for p in sorted(dev.glob("nvidia*")) if not p.is_dir()]
    caps = dev / "nvidia-caps"
    if caps.is_dir():
        found += [str(p) for p in sorted(caps.iterdir())]
    return found


def describe(settings: Settings) -> dict[str, Any]:
    """The sandbox's state on this worker, for its heartbeat and the health route."""
    if settings.sandbox == "off":
        return {"sandbox": "off", "why": "SHARDYARD_SANDBOX=off"}
    why = probe(settings.sandbox_bwrap or None)
    return {"sandbox": "on" if why is None else "unavailable", "why": why}
