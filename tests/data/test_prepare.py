"""Corpus preparation (nested.data.corpus, experiments/prepare.py): counts, EOS placement,
split determinism, shard bounds, and the one-line errors of bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from nested.data import corpus

TEXTS = {
    "a.txt": "the quick brown fox jumps over the lazy dog\n",
    "b.txt": "déjà vu: naïve café\n",
    "sub/c.txt": "def f(x):\n    return x + 1\n",
    "sub/deeper/d.txt": "a third, longer text file " * 3,
}
RECORDS = ["first record", "", "second record, with more words", "third", "fourth record here"]


def write_corpus(root: Path) -> list[corpus.Document]:
    """Writes TEXTS and docs.jsonl under ``root``; the documents in input order."""
    for rel, text in TEXTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(RECORDS)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    docs = {rel: [corpus.Document(rel, 0, text)] for rel, text in TEXTS.items()}
    docs["docs.jsonl"] = [corpus.Document("docs.jsonl", i, t) for i, t in enumerate(RECORDS) if t]
    return [d for rel in sorted(docs) for d in docs[rel]]


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    return root, write_corpus(root)


def split_of(docs, val_fraction):
    val = [d for d in docs if corpus.val_fraction_of(d.source, d.ordinal) < val_fraction]
    return [d for d in docs if d not in val], val


def read_split(out: Path, index: dict, split: str) -> np.ndarray:
    dtype = np.dtype(index["dtype"])
    files = [out / s["file"] for s in index["splits"][split]["shards"]]
    return np.concatenate([np.fromfile(f, dtype=dtype) for f in files])


VAL = 0.4  # both sides non-empty for this corpus (asserted below)


def test_bytes_counts_eos_and_contents(data, tmp_path):
    root, docs = data
    index = corpus.prepare([str(root)], tmp_path / "out", val_fraction=VAL)
    assert len(docs) == 8
    train, val = split_of(docs, VAL)
    assert len(train) >= 1 and len(val) >= 1
    assert index["format"] == "nested-tokens/1"
    assert index["tokenizer"] == {"kind": "bytes", "vocab_size": 257, "eos_id": 256, "sha256": None}
    assert index["dtype"] == "uint16"
    for split, chosen in (("train", train), ("val", val)):
        entry = index["splits"][split]
        nbytes = [len(d.text.encode()) for d in chosen]
        assert entry["documents"] == len(chosen)
        assert entry["bytes"] == sum(nbytes)
        assert entry["tokens"] == sum(nbytes) + len(chosen)
        expected = np.concatenate(
            [np.append(np.frombuffer(d.text.encode(), np.uint8), 256) for d in chosen]
        )
        got = read_split(tmp_path / "out", index, split)
        np.testing.assert_array_equal(got, expected)
        ends = np.cumsum([n + 1 for n in nbytes]) - 1
        np.testing.assert_array_equal(np.flatnonzero(got == 256), ends)  # EOS after each only
        for shard in entry["shards"]:
            assert shard["sha256"] == corpus.sha256_file(tmp_path / "out" / shard["file"])
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_bpe_counts_and_eos(data, tmp_path):
    from tokenizers import Tokenizer

    root, docs = data
    out = tmp_path / "out"
    index = corpus.prepare([str(root)], out, tokenizer="bpe", vocab_size=300, val_fraction=VAL)
    tok = index["tokenizer"]
    assert tok["kind"] == "bpe" and tok["eos_id"] == 0 and 257 <= tok["vocab_size"] <= 300
    assert tok["sha256"] == corpus.sha256_file(out / "tokenizer.json")
    hf = Tokenizer.from_file(str(out / "tokenizer.json"))
    train, val = split_of(docs, VAL)
    for split, chosen in (("train", train), ("val", val)):
        ids = [hf.encode(d.text, add_special_tokens=False).ids + [0] for d in chosen]
        expected = np.concatenate([np.array(i) for i in ids])
        got = read_split(out, index, split)
        np.testing.assert_array_equal(got, expected)
        assert index["splits"][split]["tokens"] == len(expected)
        assert np.count_nonzero(got == 0) == len(chosen)
        assert hf.decode(ids[0][:-1]) == chosen[0].text  # byte-level: lossless


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_same_input_twice_identical(data, tmp_path, tokenizer):
    root, _ = data
    a = corpus.prepare(
        [str(root)], tmp_path / "a", tokenizer=tokenizer, vocab_size=300, val_fraction=VAL
    )
    b = corpus.prepare(
        [str(root)], tmp_path / "b", tokenizer=tokenizer, vocab_size=300, val_fraction=VAL
    )
    assert a == b
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_split_is_by_document_and_stable(data, tmp_path):
    root, docs = data
    first = corpus.prepare([str(root)], tmp_path / "a", val_fraction=VAL)
    (root / "zz-new.txt").write_text("a new file added later\n")
    second = corpus.prepare([str(root)], tmp_path / "b", val_fraction=VAL)
    h = corpus.val_fraction_of("zz-new.txt", 0)
    moved = "val" if h < VAL else "train"
    for split in ("train", "val"):
        extra = int(split == moved)
        assert second["splits"][split]["documents"] == first["splits"][split]["documents"] + extra


def test_at_least_one_document_each_side(tmp_path):
    (tmp_path / "x.txt").write_text("one")
    (tmp_path / "y.txt").write_text("two")
    for fraction in (1e-12, 1 - 1e-12):  # no document / every document below it
        inputs = [str(tmp_path / "x.txt"), str(tmp_path / "y.txt")]
        index = corpus.prepare(inputs, tmp_path / f"out{fraction}", val_fraction=fraction)
        assert index["splits"]["train"]["documents"] == 1
        assert index["splits"]["val"]["documents"] == 1
    low = min(("x.txt", "y.txt"), key=lambda s: corpus.val_fraction_of(s, 0))
    index = json.loads((tmp_path / "out1e-12" / "index.json").read_text())
    assert index["splits"]["val"]["bytes"] == 3
    val = np.fromfile(tmp_path / "out1e-12" / "val-00000.bin", np.uint16)
    assert bytes(val[:-1].astype(np.uint8)) == (tmp_path / low).read_bytes()


def test_shards_bounded_and_documents_whole(data, tmp_path):
    root, docs = data
    out = tmp_path / "out"
    index = corpus.prepare([str(root)], out, val_fraction=VAL, shard_tokens=40)
    longest = max(len(d.text.encode()) + 1 for d in docs)
    assert longest > 40  # one document alone exceeds the bound: a shard of its own
    for split in ("train", "val"):
        shards = index["splits"][split]["shards"]
        assert [s["file"] for s in shards] == [f"{split}-{k:05d}.bin" for k in range(len(shards))]
        assert sum(s["documents"] for s in shards) == index["splits"][split]["documents"]
        assert sum(s["tokens"] for s in shards) == index["splits"][split]["tokens"]
        for s in shards:
            ids = np.fromfile(out / s["file"], np.uint16)
            assert len(ids) == s["tokens"] and ids[-1] == 256
            assert np.count_nonzero(ids == 256) == s["documents"]
            assert s["tokens"] <= 40 or s["documents"] == 1
    assert len(index["splits"]["train"]["shards"]) >= 3


def test_user_tokenizer_json(data, tmp_path):
    root, _ = data
    trained = corpus.prepare(
        [str(root)], tmp_path / "bpe", tokenizer="bpe", vocab_size=300, val_fraction=VAL
    )
    path = str(tmp_path / "bpe" / "tokenizer.json")
    index = corpus.prepare([str(root)], tmp_path / "user", tokenizer=path, val_fraction=VAL)
    assert index["tokenizer"]["kind"] == "file"
    assert index["tokenizer"]["eos_id"] == 0  # found <|endoftext|>
    assert index["tokenizer"]["sha256"] == trained["tokenizer"]["sha256"]
    assert index["splits"] == trained["splits"]
    with pytest.raises(corpus.PrepareError, match=r"has no token '<nope>'; pass --eos"):
        corpus.prepare([str(root)], tmp_path / "u2", tokenizer=path, eos="<nope>")


def test_overwrite(data, tmp_path):
    root, _ = data
    corpus.prepare([str(root)], tmp_path / "out", val_fraction=VAL, shard_tokens=40)
    with pytest.raises(corpus.PrepareError, match=r"already holds a prepared corpus.*--overwrite"):
        corpus.prepare([str(root)], tmp_path / "out", val_fraction=VAL)
    index = corpus.prepare([str(root)], tmp_path / "out", val_fraction=VAL, overwrite=True)
    expected = {"index.json"} | {s["file"] for sp in index["splits"].values() for s in sp["shards"]}
    assert {p.name for p in (tmp_path / "out").iterdir()} == expected  # old small shards gone


def test_failure_while_writing_leaves_nothing(data, tmp_path, monkeypatch):
    root, _ = data
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00007.bin").write_bytes(b"stale")  # a run cut off before its index
    (out / "notes.txt").write_text("the user's own file")

    def cut(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus.files, "write_atomic", cut)
    with pytest.raises(KeyboardInterrupt):
        corpus.prepare([str(root)], out, tokenizer="bpe", vocab_size=300, shard_tokens=40)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def _bad_cases(tmp_path: Path):
    ok = tmp_path / "ok.txt"
    ok.write_text("fine text\n")
    ok2 = tmp_path / "ok2.txt"
    ok2.write_text("more fine text\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "e.txt").write_text("")
    (empty / "e.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"ab\x00\x01cd")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    badjson = tmp_path / "bad.jsonl"
    badjson.write_text('{"text": "ok"}\n{not json\n')
    notok = tmp_path / "tok.json"
    notok.write_text('{"version": "1.0", "model": 3}')
    afile = tmp_path / "afile"
    afile.write_text("x")
    good = [str(ok), str(ok2)]
    return [
        ([str(tmp_path / "missing.txt")], {}, r"missing\.txt: no such file or folder"),
        ([str(empty)], {}, r"no text found"),
        ([*good, str(binary)], {}, r"bin\.dat is binary.*--skip_bad"),
        ([*good, str(latin)], {}, r"latin\.txt is not UTF-8.*--skip_bad"),
        ([*good, str(badjson)], {}, r"bad\.jsonl:2 is not JSON.*--skip_bad"),
        (good, {"tokenizer": str(notok)}, r"not a Hugging Face tokenizer\.json"),
        (good, {"tokenizer": str(tmp_path / "nope.json")}, r"nope\.json: no such file"),
        (good, {"tokenizer": "bpe", "vocab_size": 100}, r"--vocab_size=100 is too small.*>= 257"),
        (good, {"out": afile}, r"afile: is a file, not a folder"),
        ([str(ok)], {}, r"1 document; the split needs at least 2"),
        (good, {"val_fraction": 0.0}, r"--val_fraction=0.0"),
    ]


def test_bad_inputs_one_line_nothing_written(tmp_path):
    for inputs, kwargs, message in _bad_cases(tmp_path):
        out = kwargs.pop("out", tmp_path / "out")
        with pytest.raises(corpus.PrepareError, match=message) as error:
            corpus.prepare(inputs, out, **kwargs)
        assert "\n" not in str(error.value)
        assert not (tmp_path / "out").exists(), message


def test_skip_bad(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("alpha text")
    (tmp_path / "in" / "b.txt").write_text("beta text")
    (tmp_path / "in" / "bin.dat").write_bytes(b"\x00\x01\x02")
    (tmp_path / "in" / "r.jsonl").write_text('{"text": "gamma"}\n{broken\n{"no_text": 1}\n')
    logged = []
    index = corpus.prepare(
        [str(tmp_path / "in")], tmp_path / "out", val_fraction=0.5, skip_bad=True, log=logged.append
    )
    splits = index["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 3
    assert splits["train"]["bytes"] + splits["val"]["bytes"] == len("alpha textbeta textgamma")
    assert sum(line.startswith("skipped: ") for line in logged) == 3


def test_cli_error_is_one_line(tmp_path, processes):
    args = [f"--input={tmp_path}/missing", f"--out={tmp_path}/o"]
    run = processes.run("experiments/prepare.py", *args, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"error: --input {tmp_path}/missing: no such file or folder; give an existing text "
        "file, folder or .jsonl file"
    ]
    assert not (tmp_path / "o").exists()
