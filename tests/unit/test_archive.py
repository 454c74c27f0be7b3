"""core/archive.py on real archives: malicious members are refused naming the member and the
rule, a zip bomb stops at the unpacked bound (counted in real decompressed bytes, not headers),
and a good archive unpacks with its files and nothing outside the destination."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from core.archive import ArchiveError, extract_archive, inspect_archive
from tests.archives import MALICIOUS, targz, zipped


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_malicious_archives_are_refused_with_the_reason(tmp_path: Path, case: str) -> None:
    data, reason = MALICIOUS[case]
    path = tmp_path / "a"
    path.write_bytes(data)
    with pytest.raises(ArchiveError, match=reason):
        inspect_archive(path, max_unpacked=2**20)
    with pytest.raises(ArchiveError, match=reason):
        extract_archive(path, tmp_path / "out", max_unpacked=2**20)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path.parent / "evil.py").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no half-unpacked temporary left


def test_a_zip_bomb_stops_at_the_bound(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("zeros.bin", b"\0" * (8 * 2**20))  # 8 MiB of zeros deflate to ~8 KiB
    path = tmp_path / "bomb.zip"
    path.write_bytes(buf.getvalue())
    assert path.stat().st_size < 100_000
    with pytest.raises(ArchiveError, match="unpacks to more than 1 MiB"):
        extract_archive(path, tmp_path / "out", max_unpacked=2**20)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make", [targz, zipped])
def test_a_good_archive_unpacks(tmp_path: Path, make) -> None:  # noqa: ANN001
    files = {"pkg/__init__.py": b"", "pkg/model.py": b"def f():\n    return 1\n", "./data/a.txt": b"hello"}
    path = tmp_path / "ws"
    path.write_bytes(make(files))
    info = inspect_archive(path, max_unpacked=2**20)
    assert info.files == 3 and info.unpacked_bytes == sum(map(len, files.values()))
    out = tmp_path / "out"
    extract_archive(path, out, max_unpacked=2**20)
    assert (out / "pkg" / "model.py").read_bytes() == files["pkg/model.py"]
    assert (out / "data" / "a.txt").read_text() == "hello"
    # a second unpack (a retried job) finds it done and keeps it
    extract_archive(path, out, max_unpacked=2**20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ws"]
