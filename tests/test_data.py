"""The data layer: `lmledger prepare`, token-file validation, pure windows, and the DataModule under Lightning."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import platform
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lmledger import cli
from lmledger import corpus as prep
from lmledger.data import (
    TokenDataModule,
    TokenFiles,
    TrainBatches,
    load_meta,
    train_window_starts,
    val_window_starts,
)
from lmledger.errors import UserError


def _write_corpus(root: Path, n_files: int = 40) -> dict[str, bytes]:
    """A directory of small text files (plus files prepare must skip); returns {relative path: bytes} of the text."""
    texts = {}
    for i in range(n_files):
        rel = f"pkg{i % 3}/mod_{i:03d}.py"
        # Every line names its file, so a document can be traced back to where it came from.
        body = "".join(f"# {rel} line {j}: value = {i * j} é\n" for j in range(5 + i % 7))
        texts[rel] = body.encode("utf-8")
    for rel, data in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")  # NUL: binary
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (root / "empty.py").write_bytes(b"")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("hidden, never read\n")
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, _write_corpus(root)


def _documents(path: Path) -> list[bytes]:
    return path.read_bytes().split(prep.BYTE_SEPARATOR)


# ------------------------------------------------------------------------------------------ prepare


def test_prepare_writes_splits_meta_and_checksums(corpus, tmp_path):
    src, texts = corpus
    out = tmp_path / "data"
    meta = prep.prepare([str(src)], out, val_fraction=0.2)

    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]  # no temp files left
    assert json.loads((out / "meta.json").read_text()) == meta
    assert (meta["format_version"], meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == (1, "bytes", 256, "uint8")
    assert meta["python_version"] is None and meta["skipped_files"] == 2
    train, val = _documents(out / "train.bin"), _documents(out / "val.bin")
    # Split by file: every text file lands whole in exactly one split; binary, non-UTF-8 and empty ones in neither.
    assert sorted(train + val) == sorted(texts.values())
    assert len(train) == meta["train_documents"] and len(val) == meta["val_documents"] >= 1
    assert 2 <= len(val) <= 16  # ~20% of 40 files, binomial sd ~2.5
    # Documents in name order inside a split.
    names = [doc.split(b" ", 2)[1].decode() for doc in train]
    assert names == sorted(names)
    for split in ("train", "val"):
        data = (out / f"{split}.bin").read_bytes()
        assert meta[f"{split}_tokens"] == len(data)
        assert meta["sha256"][f"{split}.bin"] == hashlib.sha256(data).hexdigest()
    # The split depends only on file names: a second run gives the same bytes.
    again = prep.prepare([str(src)], tmp_path / "again", val_fraction=0.2)
    assert again["sha256"] == meta["sha256"]


def test_val_split_is_never_empty_and_single_files_are_cut(corpus, tmp_path):
    src, texts = corpus
    meta = prep.prepare([str(src)], tmp_path / "tiny-val", val_fraction=1e-9)
    assert meta["val_documents"] == 1 and meta["val_tokens"] > 0

    big = tmp_path / "one.txt"
    big.write_bytes(b"".join(texts.values()))
    meta = prep.prepare([str(big)], tmp_path / "one", val_fraction=0.1)
    train, val = (tmp_path / "one" / "train.bin").read_bytes(), (tmp_path / "one" / "val.bin").read_bytes()
    assert train + val == big.read_bytes() and val.startswith(b"# ")  # cut at a line break
    assert 0.05 < len(val) / len(big.read_bytes()) < 0.15


def test_stdlib_corpus(stdlib_data):
    meta = load_meta(stdlib_data)
    assert meta["python_version"] == platform.python_version()
    assert meta["train_tokens"] > 5_000_000 and meta["val_tokens"] > 10_000  # tens of MB of source
    files, _ = prep.list_source_files(["stdlib"])
    keys = [key for key, _ in files]
    assert keys == sorted(keys) and "os.py" in keys and "json/decoder.py" in keys
    assert not any("site-packages" in key or "dist-packages" in key for key in keys)
    assert all(key.endswith(".py") for key in keys)


@pytest.mark.parametrize(
    "vocab_size, dtype", [(2, "uint8"), (256, "uint8"), (257, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_token_dtype_is_the_smallest_that_fits(vocab_size, dtype):
    assert prep.token_dtype(vocab_size).name == dtype


def test_bpe_round_trip(corpus, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    src, texts = corpus
    out = tmp_path / "bpe"
    meta = prep.prepare([str(src)], out, tokenizer="bpe", vocab_size=300, val_fraction=0.2)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert (meta["tokenizer"], meta["dtype"], meta["vocab_size"]) == ("bpe", "uint16", tok.get_vocab_size())
    assert 257 < meta["vocab_size"] <= 300  # merges were learned
    files = TokenFiles.open(out)
    separator, docs = meta["separator_id"], []
    for split in ("train", "val"):
        ids = np.asarray(files.tokens(split))
        assert ids.max() < meta["vocab_size"]
        for part in np.split(ids, np.flatnonzero(ids == separator)):  # every part but the first starts with it
            docs.append(tok.decode(part[part != separator].tolist()).encode())
    assert sorted(docs) == sorted(texts.values())  # byte-exact round trip, files in one split each
    assert meta["train_tokens"] < sum(map(len, texts.values()))  # fewer tokens than bytes


def test_bpe_without_tokenizers_is_a_user_error(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(UserError, match="pip install tokenizers"):
        prep.prepare([str(corpus[0])], tmp_path / "x", tokenizer="bpe")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"val_fraction": 0.0}, "between 0 and 1"),
        ({"val_fraction": 1.0}, "between 0 and 1"),
        ({"vocab_size": 1000}, "bpe only"),
        ({"tokenizer": "bpe", "vocab_size": 256}, "too small"),
        ({"sources": ["/no/such/dir"]}, "does not exist"),
    ],
)
def test_prepare_rejects_bad_arguments(corpus, tmp_path, kwargs, match):
    kwargs = {"sources": [str(corpus[0])], **kwargs}
    with pytest.raises(UserError, match=match):
        prep.prepare(out=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_prepare_rejects_sources_without_text_and_out_files(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.dat").write_bytes(b"\x00\xff")
    with pytest.raises(UserError, match="no non-empty UTF-8 text files"):
        prep.prepare([str(tmp_path / "bin")], tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        prep.prepare([str(tmp_path / "bin")], tmp_path / "file")


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_cli_refuses_to_overwrite_without_flag(corpus, tmp_path, capsys):
    src, out = str(corpus[0]), tmp_path / "data"
    assert cli.main(["prepare", "--source", src, "--out", str(out)]) == 0
    assert "Prepared" in capsys.readouterr().out
    before = _snapshot(out)

    assert cli.main(["prepare", "--source", src, "--out", str(out), "--val-fraction", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "Traceback" not in err
    assert _snapshot(out) == before

    assert cli.main(["prepare", "--source", src, "--out", str(out), "--val-fraction", "0.5", "--overwrite"]) == 0
    assert load_meta(out)["val_fraction"] == 0.5 and _snapshot(out) != before


def test_interrupted_overwrite_leaves_no_meta_and_no_temp_files(corpus, tmp_path, monkeypatch):
    out = tmp_path / "data"
    prep.prepare([str(corpus[0])], out)
    real_replace = os.replace

    def crash_on_meta(src, dst):
        if Path(dst).name == "meta.json":
            raise OSError("disk vanished")
        real_replace(src, dst)

    monkeypatch.setattr(prep.os, "replace", crash_on_meta)
    with pytest.raises(UserError, match=r"disk vanished while writing .*meta\.json; .* holds no prepared data now"):
        prep.prepare([str(corpus[0])], out, val_fraction=0.5, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]
    with pytest.raises(UserError, match="no meta.json: run `lmledger prepare"):
        load_meta(out)


# ------------------------------------------------------------------------------------- validation


@pytest.fixture
def bytes_dir(corpus, tmp_path) -> Path:
    out = tmp_path / "bytes"
    prep.prepare([str(corpus[0])], out, val_fraction=0.2)
    return out


def _edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def test_missing_dir_and_meta(tmp_path):
    with pytest.raises(UserError, match="does not exist: run `lmledger prepare"):
        TokenFiles.open(tmp_path / "nope")
    with pytest.raises(UserError, match="no meta.json: run `lmledger prepare"):
        TokenDataModule(str(tmp_path))


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda d: (d / "meta.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), "not a JSON object"),
        (lambda d: _edit_meta(d, format_version=99), "format_version 99"),
        (lambda d: _edit_meta(d, train_tokens="many"), "train_tokens must be"),
        (lambda d: _edit_meta(d, dtype="float32"), "dtype must be one of"),
        (lambda d: _edit_meta(d, vocab_size=70000), "does not fit dtype"),
        (lambda d: _edit_meta(d, dtype="uint16", vocab_size=300), "written with another dtype"),
        (lambda d: (d / "val.bin").write_bytes((d / "val.bin").read_bytes()[:-7]), "truncated"),
        (lambda d: (d / "train.bin").unlink(), "train.bin is missing"),
        (lambda d: _edit_meta(d, vocab_size=100), "token id 195 but vocab_size is 100"),  # 195 = 0xC3, lead byte of é
    ],
)
def test_corrupt_data_dirs_are_user_errors(bytes_dir, corrupt, match):
    corrupt(bytes_dir)
    with pytest.raises(UserError, match=match) as err:
        TokenFiles.open(bytes_dir)
    assert "\n" not in str(err.value)


def test_context_longer_than_a_split(bytes_dir):
    meta = load_meta(bytes_dir)
    with pytest.raises(UserError, match="the val split"):
        TokenDataModule(str(bytes_dir), context_length=meta["val_tokens"])
    TokenDataModule(str(bytes_dir), context_length=meta["val_tokens"] - 1)  # exactly one window fits
    _edit_meta(bytes_dir, train_tokens=10)
    (bytes_dir / "train.bin").write_bytes(b"0123456789")
    with pytest.raises(UserError, match="the train split"):
        TokenDataModule(str(bytes_dir), context_length=10)


@pytest.mark.parametrize(
    "kwargs", [{"batch_size": 0}, {"context_length": 0}, {"num_workers": -1}, {"seed": -1}, {"val_batches": 0}]
)
def test_bad_datamodule_arguments(bytes_dir, kwargs):
    with pytest.raises(UserError, match=f"data.{next(iter(kwargs))} must be"):
        TokenDataModule(str(bytes_dir), **kwargs)


# ---------------------------------------------------------------------------------------- windows


def _first_batches(loader, n):
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            return batches
    return batches


def test_train_windows_are_slices_with_shifted_targets(stdlib_data):
    dm = TokenDataModule(str(stdlib_data), batch_size=8, context_length=32, seed=7)
    raw = np.frombuffer((stdlib_data / "train.bin").read_bytes(), dtype=np.uint8)
    for index, (x, y) in enumerate(_first_batches(dm.train_dataloader(), 3)):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 32)
        starts = train_window_starts(7, 0, index, 8, raw.size, 32)
        assert starts.min() >= 0 and starts.max() + 33 <= raw.size
        for row, start in enumerate(starts):
            assert x[row].tolist() == raw[start : start + 32].tolist()
            assert y[row].tolist() == raw[start + 1 : start + 33].tolist()


def test_train_windows_depend_only_on_seed_rank_and_index(stdlib_data):
    a = _first_batches(TokenDataModule(str(stdlib_data), batch_size=4, context_length=16, seed=3).train_dataloader(), 4)
    b = _first_batches(TokenDataModule(str(stdlib_data), batch_size=4, context_length=16, seed=3).train_dataloader(), 4)
    c = _first_batches(TokenDataModule(str(stdlib_data), batch_size=4, context_length=16, seed=4).train_dataloader(), 4)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    assert not any(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))
    assert not any(torch.equal(a[i][0], a[i + 1][0]) for i in range(3))
    n = load_meta(stdlib_data)["train_tokens"]
    assert not np.array_equal(train_window_starts(3, 0, 5, 4, n, 16), train_window_starts(3, 1, 5, 4, n, 16))
    files = TokenFiles.open(stdlib_data)
    kwargs = dict(batch_size=4, context_length=16, seed=3, epoch_length=10)
    rank1 = TrainBatches(files.bin_path("train"), files.dtype, n, rank=1, **kwargs)
    assert not torch.equal(rank1[0][0], a[0][0])
    # Any batch can be drawn directly, in any order, in another process (the dataset pickles without its map).
    rank0 = TrainBatches(files.bin_path("train"), files.dtype, n, rank=0, **kwargs)
    assert torch.equal(rank0[3][0], a[3][0])
    clone = pickle.loads(pickle.dumps(rank0))
    assert clone._tokens is None and torch.equal(clone[2][1], a[2][1])


def test_val_windows_are_consecutive_non_overlapping_and_capped(stdlib_data):
    n_val = load_meta(stdlib_data)["val_tokens"]
    raw = np.frombuffer((stdlib_data / "val.bin").read_bytes(), dtype=np.uint8)
    dm = TokenDataModule(str(stdlib_data), batch_size=16, context_length=64)
    loader = dm.val_dataloader()
    assert len(loader) == (n_val - 1) // 64 // 16
    batches = list(loader)
    starts = np.concatenate([val_window_starts(j, 16, n_val, 64) for j in range(len(batches))])
    assert np.array_equal(starts, np.arange(len(batches) * 16) * 64)  # back to back, no overlap, no gap
    x = torch.cat([b[0] for b in batches]).flatten()
    y = torch.cat([b[1] for b in batches]).flatten()
    assert x.tolist() == raw[: x.numel()].tolist() and y.tolist() == raw[1 : x.numel() + 1].tolist()
    again = list(TokenDataModule(str(stdlib_data), batch_size=16, context_length=64, seed=99).val_dataloader())
    assert all(torch.equal(p[0], q[0]) for p, q in zip(batches, again, strict=True))
    capped = TokenDataModule(str(stdlib_data), batch_size=16, context_length=64, val_batches=3).val_dataloader()
    assert len(list(capped)) == 3


def test_short_val_split_gives_one_short_batch(bytes_dir):
    n_val = load_meta(bytes_dir)["val_tokens"]
    context = max(1, (n_val - 1) // 3)  # three windows, batch of eight
    (batch,) = list(TokenDataModule(str(bytes_dir), batch_size=8, context_length=context).val_dataloader())
    assert batch[0].shape == (3, context)


def test_workers_give_the_same_batches(stdlib_data):
    kwargs = dict(batch_size=4, context_length=32, seed=11)
    serial = TokenDataModule(str(stdlib_data), num_workers=0, val_batches=6, **kwargs)
    parallel = TokenDataModule(str(stdlib_data), num_workers=2, val_batches=6, **kwargs)
    loader = parallel.train_dataloader()
    assert loader.persistent_workers
    for (xs, ys), (xp, yp) in zip(_first_batches(serial.train_dataloader(), 5), _first_batches(loader, 5), strict=True):
        assert torch.equal(xs, xp) and torch.equal(ys, yp)
    for (xs, _), (xp, _) in zip(serial.val_dataloader(), parallel.val_dataloader(), strict=True):
        assert torch.equal(xs, xp)
    # Persistent workers live as long as their loader (and a loader in a reference cycle until a gc pass):
    # stop them here, while they are idle, not during a later test.
    del loader
    gc.collect()


# -------------------------------------------------------------------------------- under Lightning


class _Recorder(pl.LightningModule):
    """Keeps every training batch it is given; the loss only has to have a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen.append(x.clone())
        return self.weight * x.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(root: Path, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


def test_resumed_run_sees_the_batches_of_an_uninterrupted_one(stdlib_data, tmp_path):
    make_dm = lambda: TokenDataModule(str(stdlib_data), batch_size=2, context_length=8, seed=5)  # noqa: E731
    full, dm = _Recorder(), make_dm()
    trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(full, datamodule=dm)
    assert trainer.num_training_batches == 8  # epoch = max_steps x accumulate_grad_batches
    assert len(full.seen) == 8
    expected = TrainBatches(
        dm.files.bin_path("train"),
        dm.files.dtype,
        dm.files.num_tokens("train"),
        batch_size=2,
        context_length=8,
        seed=5,
        rank=0,
        epoch_length=8,
    )
    assert all(torch.equal(x, expected[i][0]) for i, x in enumerate(full.seen))

    resumed, resumed_dir = _Recorder(), tmp_path / "resumed"
    trainer = _trainer(resumed_dir, [ModelCheckpoint(dirpath=resumed_dir, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(resumed, datamodule=make_dm(), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert len(resumed.seen) == 4  # steps 3 and 4, two batches each
    assert all(torch.equal(a, b) for a, b in zip(resumed.seen, full.seen[4:], strict=True))
