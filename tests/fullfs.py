"""A real full disk for tests: a tiny tmpfs mounted on a temporary folder (needs CAP_SYS_ADMIN, as
root in this container). Writes past its size fail in the kernel with ENOSPC, exactly as on a
full disk."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


def can_mount() -> bool:
    probe = Path("/proc/self/status").read_text()
    caps = next((ln.split()[1] for ln in probe.splitlines() if ln.startswith("CapEff:")), "0")
    return bool(int(caps, 16) & (1 << 21))  # CAP_SYS_ADMIN


@contextlib.contextmanager
def full_disk(where: Path, *, size_kib: int = 64) -> Iterator[Path]:
    """`where` becomes a tmpfs of `size_kib` KiB for the duration (RuntimeError if mounting is
    not permitted here)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot mount a tmpfs on {where}: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
