"""A real S3-API server process for tests: moto's standalone server (`python -m moto.server`, from
the `moto[server]` package on PyPI) on a free loopback port, speaking the S3 REST protocol over
HTTP. Production points SHARDYARD_STORAGE_URL at AWS S3, MinIO or Ceph's RGW instead; the code
under test (core/storage.py over s3fs/botocore) is the same, only the endpoint differs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api.stack import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "shardyard-test",
    "AWS_SECRET_ACCESS_KEY": "shardyard-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""moto accepts any credentials; botocore still needs some to sign its requests."""


@dataclass
class S3Server:
    log: Path
    port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        for k, v in CREDENTIALS.items():  # for the test process's own clients
            os.environ.setdefault(k, v)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The settings that point a Shardyard process at this server (add SHARDYARD_STORAGE_URL)."""
        return {**CREDENTIALS, "SHARDYARD_STORAGE_ENDPOINT_URL": self.endpoint}

    def start(self) -> S3Server:
        """Start (or start again, on the same port: moto keeps its objects in memory, so a restart
        comes back empty)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"moto server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                httpx.get(self.endpoint, timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError("moto server did not come up within 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server cannot hear SIGTERM
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, nothing answers (a hung store)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def create_bucket(self, name: str) -> None:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True).mkdir(name)
