"""Real archives for the workspace tests: good ones and the malicious kinds the server refuses."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from typing import Any

import httpx


def targz(files: dict[str, bytes], *, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info)
    return buf.getvalue()


def zipped(files: dict[str, bytes], *, links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


def tar_link(name: str, target: str, *, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info


def tar_device(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
    return info


MALICIOUS: dict[str, tuple[bytes, str]] = {
    "tar ../ path": (targz({"../evil.py": b"x = 1\n"}), "'..' component"),
    "tar absolute path": (targz({"/etc/evil": b"x"}), "absolute path"),
    "tar symlink": (targz({"ok.py": b""}, extra=[tar_link("link", "/etc/passwd")]), "is a symlink"),
    "tar hardlink": (
        targz({"ok.py": b""}, extra=[tar_link("hl", "/etc/passwd", hard=True)]),
        "is a hardlink",
    ),
    "tar device": (targz({"ok.py": b""}, extra=[tar_device("dev")]), "device, fifo or other special"),
    "zip ../ path": (zipped({"pkg/../../evil.py": b"x"}), "'..' component"),
    "zip symlink": (zipped({"ok.py": b""}, links={"link": "/etc/passwd"}), "is a symlink"),
    "not an archive": (b"hello, I am text", "neither a .tar.gz"),
}


def upload(handle: Any, body: bytes, name: str = "ws") -> httpx.Response:
    """POST /api/workspaces of a tar.gz `body`, with the client of `handle` (a StackHandle, or the
    container tests' Topology)."""
    return handle.client.post(
        "/api/workspaces", params={"name": name}, content=body, headers={"content-type": "application/gzip"}
    )
