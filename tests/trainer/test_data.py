"""The data kinds on real files written by the tests: UTF-8 text with the byte tokenizer and a
`tokenizers` JSON file trained here, nanoGPT-style token files through np.memmap, and a python
entry point. Each trains to a falling loss through the runner (the vocabulary follows the data),
and bad paths, empty files and a too-small model vocabulary are refused with the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jobrules.spec import DataSpec, JobSpec, SpecError
from tests.user_data import PERIODIC_BATCHES_PY
from trainer.config import load_job
from trainer.data import TokenFiles, data_for, load_data, with_data_vocab
from trainer.protocol import ListSink, NeverStop
from trainer.runner import run
from trainer.workspace import UserCodeError, set_workspace

TEXT = (
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade, naïve café, smörgåsbord.\n"
    "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!\n"
)


@pytest.fixture(autouse=True)
def _no_workspace():
    yield
    set_workspace(None)


def job(data: dict, *, steps: int = 30, model: dict | None = None) -> JobSpec:
    return load_job(
        {
            "model": {"kind": "gpt", "layers": 1, "d_model": 32, "heads": 2, "seq_len": 16, **(model or {})},
            "data": data,
            "train": {"steps": steps, "batch_size": 8, "lr": 3e-3, "eval_every": steps},
        }
    )


def train(spec: JobSpec) -> ListSink:
    """`spec` trained to its end: the lines it wrote."""
    sink = ListSink()
    run(spec, sink=sink, stop=NeverStop())
    return sink


def falls(sink: ListSink) -> bool:
    loss = sink.series("loss")
    return sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.3


def test_byte_tokenizer_on_a_folder_of_utf8_files(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text(TEXT * 60, encoding="utf-8")
    (tmp_path / ".hidden").write_bytes(b"\xff\xfe not utf-8, skipped because hidden")
    spec = job({"path": str(tmp_path), "tokenizer": "byte"})
    data = data_for(spec)
    assert data.vocab_size == 256
    # non-ASCII letters are several bytes each, and they are in the stream
    assert int(data.train.max()) >= 0xC3
    assert with_data_vocab(spec).model.vocab_size == 256
    assert falls(train(spec))


def test_hf_tokenizer_trained_here_and_relative_to_the_workspace(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 200, encoding="utf-8")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    vocab = tok.get_vocab_size()

    set_workspace(tmp_path)
    spec = job({"path": "corpus.txt", "tokenizer": "tokenizer.json"})
    data = data_for(spec)
    assert data.vocab_size == vocab
    expected = tok.encode(TEXT, add_special_tokens=False).ids
    assert data.train[: len(expected)].tolist() == expected
    assert falls(train(spec))
    # a model vocabulary smaller than the tokenizer's is refused before training
    with pytest.raises(
        SpecError, match=rf"data's vocabulary \({vocab}\) is larger than model.vocab_size \(100\)"
    ):
        train(job({"path": "corpus.txt", "tokenizer": "tokenizer.json"}, model={"vocab_size": 100}))


def write_tokens(folder: Path, *, n: int, vocab: int, dtype: str) -> None:
    """A learnable stream: a repeating pattern with a little noise."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, vocab, size=97)
    ids = np.tile(pattern, n // 97 + 1)[:n]
    noise = rng.random(n) < 0.05
    ids[noise] = rng.integers(0, vocab, size=int(noise.sum()))
    folder.mkdir(parents=True, exist_ok=True)
    ids.astype(dtype).tofile(folder / "train.bin")
    ids[: n // 10].astype(dtype).tofile(folder / "val.bin")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_bin_trains_through_memmap(tmp_path: Path, dtype: str) -> None:
    write_tokens(tmp_path, n=50_000, vocab=1000, dtype=dtype)
    spec = job({"kind": "tokens", "path": str(tmp_path), "dtype": dtype})
    data = data_for(spec)
    assert isinstance(data, TokenFiles)
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.dtype(dtype)
    assert data.vocab_size == int(np.fromfile(tmp_path / "train.bin", dtype=dtype).max()) + 1
    x, y = data.batch(split="train", batch_size=4, generator=torch.Generator().manual_seed(1))
    assert x.dtype == torch.int64 and x.shape == (4, 16)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert falls(train(spec))


def test_tokens_with_ids_beyond_the_stated_vocabulary_fail_with_the_reason(tmp_path: Path) -> None:
    write_tokens(tmp_path, n=5_000, vocab=1000, dtype="uint16")
    with pytest.raises(SpecError, match=r"token id \d+ in train.bin is >= data.vocab_size \(10\)"):
        train(job({"kind": "tokens", "path": str(tmp_path), "vocab_size": 10}))


def test_bad_paths_and_empty_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="data.path: .*nope does not exist"):
        load_data(DataSpec(path=str(tmp_path / "nope")), seq_len=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="holds no files"):
        load_data(DataSpec(path=str(tmp_path / "empty")), seq_len=16)
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(SpecError, match="holds no text"):
        load_data(DataSpec(path=str(tmp_path / "blank.txt")), seq_len=16)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1") * 100)
    with pytest.raises(SpecError, match="latin1.txt is not UTF-8 text"):
        load_data(DataSpec(path=str(tmp_path / "latin1.txt")), seq_len=16)
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(SpecError, match="too few for model.seq_len 16"):
        load_data(DataSpec(path=str(tmp_path / "short.txt")), seq_len=16)
    tokens = tmp_path / "tok"
    tokens.mkdir()
    (tokens / "train.bin").write_bytes(b"\x00" * 1001)
    (tokens / "val.bin").write_bytes(b"\x00" * 1000)
    with pytest.raises(SpecError, match="1001 bytes, not a whole number of uint16 tokens"):
        load_data(DataSpec(kind="tokens", path=str(tokens)), seq_len=16)
    (tokens / "train.bin").write_bytes(b"\x00" * 1000)
    (tokens / "val.bin").unlink()
    with pytest.raises(SpecError, match="val.bin does not exist"):
        load_data(DataSpec(kind="tokens", path=str(tokens), dtype="uint16"), seq_len=16)
    with pytest.raises(SpecError, match="relative but the job has no workspace"):
        load_data(DataSpec(path="data.txt"), seq_len=16)
    set_workspace(tmp_path)
    with pytest.raises(SpecError, match="points outside the workspace"):
        load_data(DataSpec(path="../../etc/passwd"), seq_len=16)
    with pytest.raises(SpecError, match="no tokenizer file"):
        load_data(DataSpec(path="blank.txt", tokenizer="missing.json"), seq_len=16)


def test_python_data_entry_point(tmp_path: Path) -> None:
    broken = "\ndef broken(**kwargs):\n    return 42\n"
    (tmp_path / "mydata.py").write_text(PERIODIC_BATCHES_PY.decode() + broken)
    set_workspace(tmp_path)
    spec = job({"kind": "python", "entry": "mydata:batches", "args": {"period": 11}, "vocab_size": 11})
    assert falls(train(spec))
    with pytest.raises(
        UserCodeError, match=r"data.entry must return \(train, val\) iterables of batches, got int"
    ):
        train(job({"kind": "python", "entry": "mydata:broken", "vocab_size": 11}))
    with pytest.raises(UserCodeError, match="no module 'nothere'"):
        train(job({"kind": "python", "entry": "nothere:x", "vocab_size": 11}))
    sys.modules.pop("mydata", None)


def test_stdlib_files_are_the_filtered_tree_in_order():
    """The pruned walk lists exactly the .py files a full walk keeps (no skipped folder at any
    depth), in the same order: the stdlib corpus, and so every default job's data, is unchanged."""
    import sysconfig

    from trainer.data import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    full = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    assert stdlib_files() == sorted(full, key=lambda p: p.relative_to(root).as_posix())
