"""Corpus preparation: text files / JSONL -> flat token shards + ``index.json`` (format
``nested-tokens/1``), read back by :class:`nested.data.tokens.TokensTask`.

Entry point: ``python experiments/prepare.py --input DATA --out DIR`` (flags there); the work is
:func:`prepare`.

**Inputs.** A text file is one document; a folder is read recursively (files sorted by relative
path, each a document, ``.jsonl`` files inside it read as JSONL); a ``.jsonl`` file holds one
JSON object per line whose ``text`` field (a string) is a document. Empty documents (no text) are
skipped. Text must be UTF-8; a file with a NUL byte is binary. Binary or non-UTF-8 files, and
JSONL lines that do not parse or lack a string ``text``, are refused naming the file (and line)
unless ``skip_bad`` (then they are skipped and counted).

**Tokenizers.** ``bytes``: ids 0-255 are the UTF-8 bytes, 256 is end-of-document (vocab 257).
``bpe``: a byte-level BPE trained on the corpus with Hugging Face ``tokenizers`` (the special
token ``<|endoftext|>`` is id 0 and the end-of-document; initial alphabet the 256 byte symbols,
so ``vocab_size >= 257``), saved as ``out/tokenizer.json``. A path: a user's ``tokenizer.json``
read locally and copied to ``out/``; its end-of-document is ``eos`` when given, else the first of
:data:`EOS_CANDIDATES` it has. Nothing is fetched from a hub. Documents are encoded without the
tokenizer's own special tokens (``add_special_tokens=False``); the EOS id follows each document.
:func:`prepared_tokenizer` gives back the tokenizer of a prepared folder (evaluation tokenizes
text with it).

**Split.** By document: a document goes to ``val`` when ``h < val_fraction``, ``h`` the first 8
bytes of SHA-256 of ``f"{source}\\n{ordinal}"`` read as a big-endian fraction of 2**64.
``source`` is the file's path relative to its ``--input`` folder (a file given directly: its
name), ``ordinal`` the document's line number (from 0) in a JSONL file, 0 for a text file. The
split of a document does not move when other documents are added. If no document (or every
document) falls below the threshold, the one with the smallest (largest) ``h`` changes side, so
each split has at least one document (the corpus needs 2).

**Output.** ``out/<split>-<k:05d>.bin``: the split's documents in input order, each one's tokens
followed by the EOS id, flat little-endian ``uint16`` (vocab <= 65536) or ``uint32``; a shard is
closed before a document that would take it past ``shard_tokens`` tokens, so documents are
never split (a document longer than ``shard_tokens`` gets a shard of its own). ``out/index.json``
(written last, atomically: a run cut off leaves no index, and a folder with an index is refused
unless ``overwrite``)::

    {"format": "nested-tokens/1",
     "tokenizer": {"kind": "bytes" | "bpe" | "file", "vocab_size", "eos_id",
                   "sha256": of out/tokenizer.json, null for bytes},
     "dtype": "uint16" | "uint32",
     "splits": {"train" | "val": {"documents", "tokens" (EOS included),
                                  "bytes" (UTF-8 bytes of the documents' text: bits per byte),
                                  "shards": [{"file", "documents", "tokens", "sha256"}]}}}

**Why flat memory-mapped files, not ArrayRecord.** Training reads by index: batch ``i`` of a split
is a pure function of ``(seed, split, i)`` (see ``nested.data.batch``), so a resumed run reads
exactly the batches an uninterrupted one would, its data position being the step stored in the
orbax checkpoint; no iterator state is saved. A flat file of token ids gives that random access
for free (``numpy.memmap``: window ``w`` is a slice at offset ``w * T``, the page cache does the
caching), its checksum is the file's SHA-256, and it needs no extra dependency or record framing.
ArrayRecord gives random access to *records* (documents), but packed windows straddle documents,
so a window would need several record reads and a document-offset table on top: the flat stream
is that table already.

**Memory.** Streaming, document by document: pass 1 reads every document once (validating it,
deciding the split, counting; with ``bpe`` it feeds ``tokenizers``' ``train_from_iterator``, whose
own state is its word counts and merges), pass 2 reads it again, tokenizes it and appends its
tokens to the open shard of its split. Peak memory is bounded by one document (its text and its
tokens) plus the BPE trainer's state, below one shard plus one document: a shard is never held in
memory. Nothing is half-written: input errors are found in pass 1, before any file is created,
and a failure in pass 2 removes the files this run wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nested import files

FORMAT = "nested-tokens/1"
INDEX = "index.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
BYTES_EOS = 256
BPE_EOS = "<|endoftext|>"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
SHARD_NAME = re.compile(r"^(train|val)-\d{5}\.bin$")
_READ_CHUNK = 1 << 20


class PrepareError(ValueError):
    """A bad input to :func:`prepare`; its message is one line naming the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of the corpus: ``source`` (relative path), ``ordinal`` in it, its text."""

    source: str
    ordinal: int
    text: str


def val_fraction_of(source: str, ordinal: int) -> float:
    """The split hash ``h`` in [0, 1) of a document (see the module docstring)."""
    digest = hashlib.sha256(f"{source}\n{ordinal}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- reading


def _files(inputs: Sequence[str]) -> list[tuple[Path, str]]:
    """``(path, source)`` of every file of ``inputs``, folders expanded (sorted) recursively."""
    if not inputs:
        raise PrepareError("no --input given; pass a text file, a folder or a .jsonl file")
    found = []
    for given in inputs:
        root = Path(given)
        if root.is_file():
            found.append((root, root.name))
        elif root.is_dir():
            files = sorted(
                (f for f in root.rglob("*") if f.is_file()), key=lambda f: f.relative_to(root)
            )
            found.extend((f, f.relative_to(root).as_posix()) for f in files)
        elif root.exists():
            raise PrepareError(f"--input {given}: neither a file nor a folder; give text files")
        else:
            raise PrepareError(
                f"--input {given}: no such file or folder; give an existing text file, folder or "
                ".jsonl file"
            )
    return found


def _text_of(path: Path) -> str:
    """The UTF-8 text of ``path``, or raises ``_Bad`` with the reason."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise _Bad("is binary (it has NUL bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _Bad(f"is not UTF-8 (byte {error.start})") from None


class _Bad(Exception):
    """A file or a line that is not a document (caught where the file name is known)."""


def _jsonl_documents(path: Path, source: str, on_bad: Callable[[str], None]) -> Iterator[Document]:
    with open(path, "rb") as f:
        for ordinal, line in enumerate(f):
            where = f"{path}:{ordinal + 1}"
            if not line.strip():
                continue
            if b"\x00" in line:
                on_bad(f"{where} is binary (it has NUL bytes)")
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                on_bad(f"{where} is not UTF-8")
                continue
            except json.JSONDecodeError as error:
                on_bad(f"{where} is not JSON ({error.msg})")
                continue
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                on_bad(f"{where} has no string 'text' field")
                continue
            if text:
                yield Document(source, ordinal, text)


def documents(
    inputs: Sequence[str], *, skip_bad: bool = False, bad: list[str] | None = None
) -> Iterator[Document]:
    """Every non-empty document of ``inputs``, in order (see the module docstring). A bad file
    or line raises :class:`PrepareError` naming it, or with ``skip_bad`` is appended to ``bad``
    and skipped."""

    def on_bad(what: str) -> None:
        if not skip_bad:
            raise PrepareError(f"{what}; fix or remove it, or pass --skip_bad to skip it")
        if bad is not None:
            bad.append(what)

    for path, source in _files(inputs):
        try:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, source, on_bad)
                continue
            try:
                text = _text_of(path)
            except _Bad as reason:
                on_bad(f"{path} {reason}")
                continue
        except OSError as error:
            raise PrepareError(
                f"{path}: cannot be read ({error.strerror}); make it readable or leave it out"
            ) from None
        if text:
            yield Document(source, 0, text)


# ----------------------------------------------------------------------------- tokenizers


@dataclasses.dataclass
class Tokenizer:
    """What preparation needs of a tokenizer: ``encode(text) -> ids (N,)``, its vocabulary and
    EOS id, its kind and (not bytes) the Hugging Face tokenizer to save."""

    kind: str
    vocab_size: int
    eos_id: int
    encode: Callable[[str], np.ndarray]
    hf: Any = None
    raw: bytes | None = None  # a user's tokenizer.json as read (copied to out/ as it is)

    def decode(self, ids) -> str:
        """The text of token ``ids``: the UTF-8 bytes (ids past 255, EOS, dropped; a cut
        character replaced) or the Hugging Face tokenizer's decoding (special tokens kept)."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    def unknown(self, text: str) -> list[str]:
        """The pieces of ``text`` this tokenizer encodes as its unknown token (none for bytes
        or a byte-level BPE, which encode any text)."""
        unk = getattr(getattr(self.hf, "model", None), "unk_token", None)
        unk_id = None if unk is None else self.hf.token_to_id(unk)
        if unk_id is None:
            return []
        found = self.hf.encode(text, add_special_tokens=False)
        pieces = zip(found.ids, found.offsets, strict=True)
        return [text[a:b] for i, (a, b) in pieces if i == unk_id]


def bytes_tokenizer() -> Tokenizer:
    """UTF-8 bytes, EOS 256, vocab 257."""
    encode = lambda text: np.frombuffer(text.encode("utf-8"), np.uint8)
    return Tokenizer("bytes", BYTES_EOS + 1, BYTES_EOS, encode)


def _hf_tokenizer(kind: str, hf: Any, eos: str, where: str) -> Tokenizer:
    eos_id = hf.token_to_id(eos)
    if eos_id is None:
        raise PrepareError(f"{where}: has no token {eos!r}; pass --eos=<a token it has>")
    vocab = hf.get_vocab(with_added_tokens=True)
    vocab_size = max(max(vocab.values()) + 1, hf.get_vocab_size(with_added_tokens=True))
    return Tokenizer(kind, vocab_size, eos_id, encode_with(hf), hf)


def encode_with(hf: Any) -> Callable[[str], np.ndarray]:
    """``text -> ids (N,)`` int64 of a Hugging Face tokenizer, without its special tokens."""
    return lambda text: np.asarray(hf.encode(text, add_special_tokens=False).ids, np.int64)


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens at most (``<|endoftext|>`` is id 0) trained on
    the streamed ``texts`` with ``tokenizers``' iterator trainer."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise PrepareError(
            f"--vocab_size={vocab_size} is too small for a byte-level BPE: it needs the 256 byte "
            "symbols and the end-of-document token; use --vocab_size >= 257 (e.g. 8192)"
        )
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return _hf_tokenizer("bpe", hf, BPE_EOS, "the trained BPE")


def load_tokenizer(path: str, eos: str | None = None) -> Tokenizer:
    """A user's ``tokenizer.json`` at ``path`` (local); EOS ``eos`` or the first of
    :data:`EOS_CANDIDATES` it has."""
    from tokenizers import Tokenizer as HF

    file = Path(path)
    if not file.is_file():
        raise PrepareError(
            f"--tokenizer={path}: no such file; use bytes, bpe or the path of a tokenizer.json"
        )
    try:
        raw = file.read_bytes()
        hf = HF.from_str(raw.decode("utf-8"))
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PrepareError(
            f"--tokenizer={path}: not a Hugging Face tokenizer.json ({first}); give the "
            "tokenizer.json of a tokenizers/transformers tokenizer, or --tokenizer=bpe"
        ) from None
    if eos is None:
        vocab = hf.get_vocab(with_added_tokens=True)
        eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise PrepareError(
                f"--tokenizer={path}: none of {list(EOS_CANDIDATES)} is in its vocabulary; name "
                "its end-of-document token with --eos"
            )
    return dataclasses.replace(_hf_tokenizer("file", hf, eos, f"--tokenizer={path}"), raw=raw)


def prepared_tokenizer(folder: str | Path, index: dict) -> Tokenizer:
    """The tokenizer the shards of the prepared ``folder`` (its ``index``) were made with, to
    tokenize text as they were: ``bytes``, or the folder's ``tokenizer.json`` (its SHA-256 is
    checked against the index; EOS the index's ``eos_id``). Raises :class:`PrepareError`."""
    tok = index["tokenizer"]
    if tok["kind"] == "bytes":
        return bytes_tokenizer()
    from tokenizers import Tokenizer as HF

    file = Path(folder) / TOKENIZER_FILE
    if not file.is_file() or sha256_file(file) != tok["sha256"]:
        found = "is missing" if not file.is_file() else "does not match the index's sha256"
        raise PrepareError(f"{file} {found}; prepare {folder} again with experiments/prepare.py")
    hf = HF.from_file(str(file))
    return _hf_tokenizer(tok["kind"], hf, hf.id_to_token(tok["eos_id"]), str(file))


def run_tokenizer(task, vocab: int, given: str | None = None) -> Tokenizer | None:
    """The tokenizer text is encoded with for a run of ``task`` whose model has ``vocab`` ids:
    ``given`` ``"bytes"`` or the path of a ``tokenizer.json`` (held to the task's
    ``tokenizer_sha256`` where it names one); None: the task's own (``task.text_tokenizer()``:
    a prepared corpus's, a text companion task's), or None for a task without one. Raises a
    ``ValueError`` (:class:`PrepareError` or the task's) when it cannot be read, is not the
    run's, or has more ids than ``vocab``; callers add the flag and the fix to its message."""
    if given == "bytes":
        tokenizer = bytes_tokenizer()
    elif given is not None:
        tokenizer = load_tokenizer(given)
        sha = getattr(task, "tokenizer_sha256", None)
        if sha is not None and sha256_file(Path(given)) != sha:
            raise PrepareError(f"not the tokenizer.json of sha256={sha} the run trained with")
    else:
        own = getattr(task, "text_tokenizer", None)
        tokenizer = None if own is None else own()
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise PrepareError(
            f"its vocabulary ({tokenizer.vocab_size}) is larger than the model's ({vocab})"
        )
    return tokenizer


# ----------------------------------------------------------------------------- writing


class _ShardWriter:
    """Appends documents to ``<split>-<k:05d>.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, written: list):
        self.out, self.split, self.dtype, self.limit = out, split, dtype, shard_tokens
        self.written = written  # every path created, for the cleanup on failure
        self.shards: list[dict] = []
        self.file = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.written.append(self.out / name)
        self.file = open(self.out / name, "wb")  # noqa: SIM115 - closed in _close
        self.hash = hashlib.sha256()
        self.shards.append({"file": name, "documents": 0, "tokens": 0, "sha256": None})

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.shards[-1]["sha256"] = self.hash.hexdigest()
            self.file = None

    def add(self, ids: np.ndarray) -> None:
        """Append one document's ``ids`` (EOS included), opening a new shard when it would not
        fit in the current one."""
        current = self.shards[-1] if self.file is not None else None
        if current is None or (current["tokens"] and current["tokens"] + len(ids) > self.limit):
            self._close()
            self._open()
        data = np.ascontiguousarray(ids, dtype=self.dtype.newbyteorder("<")).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.shards[-1]["documents"] += 1
        self.shards[-1]["tokens"] += len(ids)

    def finish(self) -> list[dict]:
        self._close()
        return self.shards


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: is a file, not a folder; give a folder path")
    if (out / INDEX).exists() and not overwrite:
        raise PrepareError(
            f"--out {out}: already holds a prepared corpus ({INDEX}); pass --overwrite to "
            "replace it or choose another --out"
        )


def _clear(out: Path) -> None:
    """Remove a previous run's index (first: a rerun cut off leaves none), shards, tokenizer
    (only files of those names: anything else in ``out`` stays)."""
    (out / INDEX).unlink(missing_ok=True)
    for f in out.iterdir():
        if SHARD_NAME.match(f.name) or f.name == TOKENIZER_FILE:
            f.unlink()


# ----------------------------------------------------------------------------- prepare


@dataclasses.dataclass
class _Scan:
    documents: int = 0
    val: int = 0
    lowest: tuple[float, str, int] | None = None  # smallest h: moved to val if val is empty
    highest: tuple[float, str, int] | None = None  # largest h: moved to train if train is empty


def _scanned(docs: Iterator[Document], val_fraction: float, scan: _Scan) -> Iterator[str]:
    """The texts of ``docs``, counting them and their split into ``scan`` on the way."""
    for doc in docs:
        h = val_fraction_of(doc.source, doc.ordinal)
        scan.documents += 1
        scan.val += h < val_fraction
        key = (h, doc.source, doc.ordinal)
        scan.lowest = key if scan.lowest is None else min(scan.lowest, key)
        scan.highest = key if scan.highest is None else max(scan.highest, key)
        yield doc.text


def prepare(
    inputs: Sequence[str],
    out: str | Path,
    *,
    tokenizer: str = "bytes",
    vocab_size: int = 8192,
    val_fraction: float = 0.01,
    shard_tokens: int = 1 << 27,
    eos: str | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Tokenize the documents of ``inputs`` into shards and an index in ``out`` (module
    docstring); returns the index. Raises :class:`PrepareError` (one line) on bad input, with
    nothing written."""
    out = Path(out)
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"--val_fraction={val_fraction}: use a fraction 0 < f < 1 (e.g. 0.01)")
    if shard_tokens < 1:
        raise PrepareError(f"--shard_tokens={shard_tokens}: use a positive number of tokens")
    _check_out(out, overwrite)
    if tokenizer not in ("bytes", "bpe"):
        tok = load_tokenizer(tokenizer, eos)  # before the scan: a bad file fails at once
    elif eos is not None:
        raise PrepareError(f"--eos={eos!r} applies to a tokenizer.json only; leave it out")
    elif tokenizer == "bpe" and vocab_size < 257:
        train_bpe(iter(()), vocab_size)  # raises the one-line error

    bad: list[str] = []
    scan = _Scan()
    texts = _scanned(documents(inputs, skip_bad=skip_bad, bad=bad), val_fraction, scan)
    if tokenizer == "bytes":
        tok = bytes_tokenizer()
        for _ in texts:
            pass
    elif tokenizer == "bpe":
        tok = train_bpe(texts, vocab_size)
    else:
        for _ in texts:
            pass
    if scan.documents == 0:
        raise PrepareError(
            f"--input {','.join(inputs)}: no text found (empty files or records); give files "
            "with text or .jsonl lines with a non-empty 'text'"
        )
    if scan.documents < 2:
        raise PrepareError(
            f"--input {','.join(inputs)}: 1 document; the split needs at least 2 (one train, "
            "one val): add documents (a .jsonl line or a file each)"
        )
    force_val = scan.lowest[1:] if scan.val == 0 else None
    force_train = scan.highest[1:] if scan.val == scan.documents else None

    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    created_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)  # an old corpus (overwrite) or the leftovers of a run cut off before its index
    written: list[Path] = []
    writers = {s: _ShardWriter(out, s, dtype, shard_tokens, written) for s in SPLITS}
    try:
        sha = None
        if tok.hf is not None:
            written.append(out / TOKENIZER_FILE)
            if tok.raw is not None:
                (out / TOKENIZER_FILE).write_bytes(tok.raw)
            else:
                tok.hf.save(str(out / TOKENIZER_FILE))
            sha = sha256_file(out / TOKENIZER_FILE)
        counts = {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in SPLITS}
        eos_row = np.array([tok.eos_id], np.int64)
        for doc in documents(inputs, skip_bad=skip_bad):
            key = (doc.source, doc.ordinal)
            to_val = val_fraction_of(*key) < val_fraction
            split = "val" if (to_val or key == force_val) and key != force_train else "train"
            ids = np.concatenate([tok.encode(doc.text).astype(np.int64), eos_row])
            writers[split].add(ids)
            counts[split]["documents"] += 1
            counts[split]["tokens"] += len(ids)
            counts[split]["bytes"] += len(doc.text.encode("utf-8"))
        index = {
            "format": FORMAT,
            "tokenizer": {
                "kind": tok.kind,
                "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id,
                "sha256": sha,
            },
            "dtype": dtype.name,
            "splits": {s: {**counts[s], "shards": writers[s].finish()} for s in SPLITS},
        }
        files.write_atomic(out / INDEX, json.dumps(index, indent=1) + "\n")
    except BaseException:
        for writer in writers.values():
            writer.finish()
        for path in written:
            path.unlink(missing_ok=True)
        if created_out and not any(out.iterdir()):
            out.rmdir()
        raise
    for what in bad:
        log(f"skipped: {what}")
    for s in SPLITS:
        c, shards = counts[s], len(index["splits"][s]["shards"])
        log(f"{s}: {c['documents']} documents, {c['tokens']} tokens, {shards} shard(s)")
    return index
