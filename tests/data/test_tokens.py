"""The task ``tokens`` (nested.data.tokens): packed windows against a plain numpy packing,
document ids, grain's per-epoch shuffle, resume exactness, per-process rows, one-line errors."""

import json
import shutil

import grain
import numpy as np
import pytest
from helpers.lm import document_texts

from nested.data import TokensTask, corpus, make_task
from nested.data.tokens import align_documents, document_ids
from nested.run import pieces, train

T = 8
EOS = 256


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    lines = [json.dumps({"text": t}) for t in document_texts()]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "out"
    index = corpus.prepare([str(root / "docs.jsonl")], out, val_fraction=0.3, shard_tokens=50)
    assert len(index["splits"]["train"]["shards"]) > 3  # windows straddle shards
    return out, index


def reference_stream(index, split: str) -> np.ndarray:
    """The plain packing: every document's UTF-8 bytes then EOS, in input order."""
    texts = document_texts()
    is_val = [corpus.val_fraction_of("docs.jsonl", i) < 0.3 for i in range(len(texts))]
    chosen = [t for t, v in zip(texts, is_val, strict=True) if v == (split == "val")]
    assert len(chosen) == index["splits"][split]["documents"]
    return np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), EOS) for t in chosen])


def reference_windows(index, split: str, t: int = T) -> np.ndarray:
    stream = reference_stream(index, split).astype(np.int32)
    n = (len(stream) - 1) // t
    return np.stack([stream[w * t : w * t + t + 1] for w in range(n)])


def reference_documents(inputs: np.ndarray) -> np.ndarray:
    docs = np.zeros(inputs.shape, np.int32)
    for b in range(inputs.shape[0]):
        for t in range(1, inputs.shape[1]):
            docs[b, t] = docs[b, t - 1] + (inputs[b, t - 1] == EOS)
    return docs


def test_val_batches_are_the_packing_in_order(prepared):
    out, index = prepared
    task = TokensTask(path=str(out), seq_len=T, eval_seq_len=12)
    windows = reference_windows(index, "val", 12)
    batch = task.batch(1, 3, split="val")
    np.testing.assert_array_equal(batch.inputs, windows[3:6, :-1])
    np.testing.assert_array_equal(batch.targets, windows[3:6, 1:])
    assert batch.inputs.dtype == np.int32 and batch.inputs.shape == (3, 12)
    np.testing.assert_array_equal(batch.mask, np.ones((3, 12), np.float32))
    np.testing.assert_array_equal(batch.extras["documents"], reference_documents(batch.inputs))
    n = len(windows)  # rows past the end wrap around
    np.testing.assert_array_equal(task.batch(n, 1, split="val").inputs, windows[:1, :-1])


def test_train_epochs_are_grain_shuffles(prepared):
    out, index = prepared
    windows = reference_windows(index, "train")
    n = len(windows)
    assert n > 40
    task = TokensTask(path=str(out), seq_len=T, seed=5)
    rows = np.concatenate([task.batch(i, 4).inputs for i in range(-(-2 * n // 4))])[: 2 * n]
    for epoch in (0, 1):
        perm = grain.MapDataset.range(n).shuffle(seed=5 + epoch)
        order = np.array([perm[p] for p in range(n)])
        assert sorted(order) == list(range(n))  # each window once per epoch
        np.testing.assert_array_equal(rows[epoch * n : (epoch + 1) * n], windows[order, :-1])
    assert not np.array_equal(rows[:n], rows[n:])
    # epoch e of seed s is epoch 0 of seed s + e
    later = TokensTask(path=str(out), seq_len=T, seed=6)
    np.testing.assert_array_equal(task.window("train", n + 3), later.window("train", 3))


def test_document_ids_at_a_boundary(prepared):
    out, _ = prepared
    task = TokensTask(path=str(out), seq_len=T)
    batch = task.batch(0, 16)
    docs = batch.extras["documents"]
    assert docs.shape == (16, T) and docs.dtype == np.int32
    np.testing.assert_array_equal(docs, reference_documents(batch.inputs))
    b, t = next(
        (b, t) for b, t in zip(*np.nonzero(batch.inputs == EOS), strict=True) if 0 < t < T - 1
    )
    assert docs[b, t] == docs[b, t - 1]  # the EOS ends its document
    assert docs[b, t + 1] == docs[b, t] + 1  # the next position starts a new one
    assert batch.targets[b, t - 1] == EOS
    assert (docs[:, 0] == 0).all()


def test_align_documents_by_hand():
    window = np.array([104, 105, EOS, 111, 107, EOS, 97])
    aligned, real = align_documents(window, EOS, 4)
    np.testing.assert_array_equal(aligned, [104, 105, EOS, EOS, 111, 107, EOS, EOS, 97])
    np.testing.assert_array_equal(real, [1, 1, 1, 0, 1, 1, 1, 0, 1])
    # the pads stay in the document they end
    np.testing.assert_array_equal(document_ids(aligned[None], EOS), [[0, 0, 0, 0, 1, 1, 1, 1, 2]])
    same, real = align_documents(window, EOS, 1)
    np.testing.assert_array_equal(same, window)
    assert real.all()


def test_aligned_batches_start_every_document_on_the_grid(prepared):
    """With ``align=A`` every document after a row's first starts at a multiple of A, the pads
    are never scored, and the scored targets are the plain window's tokens in order."""
    out, _ = prepared
    A, t = 8, 32
    aligned = TokensTask(path=str(out), seq_len=t, align=A).batch(1, 16)
    plain = TokensTask(path=str(out), seq_len=t).batch(1, 16)
    docs = aligned.extras["documents"]
    np.testing.assert_array_equal(docs, document_ids(aligned.inputs, EOS))
    rows, starts = np.nonzero(docs[:, 1:] != docs[:, :-1])
    assert len(starts) > 4 and ((starts + 1) % A == 0).all()
    assert 0 < (aligned.mask == 0).sum() < aligned.mask.size // 2
    assert (aligned.targets[aligned.mask == 0] == EOS).all()
    for b in range(16):
        scored = aligned.targets[b][aligned.mask[b] > 0]
        np.testing.assert_array_equal(scored, plain.targets[b][: len(scored)])


def test_the_declared_grid_is_where_every_window_starts_its_documents(prepared, monkeypatch):
    """``document_grid``: the align (down to what the window lengths share with it: eval
    windows are cut from one aligned stream), 1 without documents; the training loop refuses
    a batch whose documents start elsewhere, naming the grid."""
    out, _ = prepared
    grid = lambda **kw: TokensTask(path=str(out), **kw).document_grid
    assert grid(seq_len=32, align=8) == 8
    assert grid(seq_len=32, align=8, eval_seq_len=20) == 4
    assert (grid(seq_len=32), grid(seq_len=32, align=8, documents=False)) == (1, 1)
    task = TokensTask(path=str(out), seq_len=32, align=8)
    batch = pieces.stacked_batches(task, 1, 2, 16)  # checked on the grid
    assert batch["documents"].shape == (2, 16, 32)
    off = TokensTask(path=str(out), seq_len=32, align=4)
    monkeypatch.setattr(TokensTask, "document_grid", 8)  # declared 8, laid out on 4
    with pytest.raises(train.ConfigError, match=r"training batch 1: a document starts at"):
        pieces.stacked_batches(off, 1, 1, 16)


def test_resume_reads_the_same_batch(prepared):
    out, _ = prepared
    first = TokensTask(path=str(out), seq_len=T, seed=3)
    seen = [first.batch(i, 8) for i in range(8)]
    fresh = TokensTask(path=str(out), seq_len=T, seed=3).batch(7, 8)
    for key in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(getattr(fresh, key), getattr(seen[7], key))
    np.testing.assert_array_equal(fresh.extras["documents"], seen[7].extras["documents"])
    assert not np.array_equal(seen[6].inputs, seen[7].inputs)


@pytest.mark.parametrize("rows", [slice(2, 6), slice(None, None, 3), slice(7, None)])
def test_rows_equal_slicing_the_full_batch(prepared, rows):
    out, _ = prepared
    task = TokensTask(path=str(out), seq_len=T)
    full, part = task.batch(3, 8), task.batch(3, 8, rows=rows)
    np.testing.assert_array_equal(part.inputs, full.inputs[rows])
    np.testing.assert_array_equal(part.targets, full.targets[rows])
    np.testing.assert_array_equal(part.extras["documents"], full.extras["documents"][rows])


def test_stacked_batches_passes_rows(prepared, monkeypatch):
    out, _ = prepared
    task = make_task("tokens", path=str(out), seq_len=T)
    asked = []
    original = TokensTask.batch

    def spy(self, index, batch_size, *, split="train", rows=None):
        asked.append(rows)
        return original(self, index, batch_size, split=split, rows=rows)

    monkeypatch.setattr(TokensTask, "batch", spy)
    got = pieces.stacked_batches(task, 2, 3, 8, rows=slice(4, 8))
    assert asked == [slice(4, 8)] * 3
    assert got["inputs"].shape == (3, 4, T)
    np.testing.assert_array_equal(got["inputs"][1], original(task, 3, 8).inputs[4:8])
    pieces.check_task(task)


def test_prefetch_yields_the_same_batches(prepared):
    out, _ = prepared
    task = TokensTask(path=str(out), seq_len=T, seed=1)
    got = []
    for i, batch in task.prefetch(5, 4, threads=2, buffer=3):
        got.append((i, batch))
        if len(got) == 4:
            break
    assert [i for i, _ in got] == [5, 6, 7, 8]
    for i, batch in got:
        np.testing.assert_array_equal(batch.inputs, task.batch(i, 4).inputs)


def test_bad_configs_are_one_line(prepared, tmp_path):
    out, index = prepared
    cases = [
        (dict(vocab_size=100), r"vocab_size=100 is smaller than the tokenizer's vocab_size=257"),
        (dict(tokenizer_sha256="ab" * 32), r"come from tokenizer sha256=None.*tokenizer_sha256="),
        (dict(seq_len=10**6), r"the train split .* fewer than one window of T \+ 1 = 1000001"),
        (dict(path=str(tmp_path)), r"has no index\.json; prepare it"),
        (dict(path=None), r"path is not set"),
    ]
    for fields, message in cases:
        task = TokensTask(**{"path": str(out), "seq_len": T, **fields})
        with pytest.raises(ValueError, match=message) as error:
            task.batch(0, 2)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"seq_len=0 is invalid"):
        TokensTask(path=str(out), seq_len=0)
    with pytest.raises(ValueError, match=r"align=0 is invalid.*use a positive int"):
        TokensTask(path=str(out), seq_len=T, align=0)
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "train-00001.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match=r"train-00001\.bin is 2 bytes, the index says"):
        TokensTask(path=str(broken), seq_len=T).batch(0, 1)
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    data = bytearray((damaged / "val-00000.bin").read_bytes())
    data[0] ^= 1
    (damaged / "val-00000.bin").write_bytes(bytes(data))
    TokensTask(path=str(out), seq_len=T).verify()
    with pytest.raises(ValueError, match=r"val-00000\.bin does not match its sha256"):
        TokensTask(path=str(damaged), seq_len=T).verify()
    assert "vocab 257" in TokensTask(path=str(out), seq_len=T).describe()
