"""Language modelling on a prepared token corpus (``experiments/prepare.py``, format
``nested-tokens/1``, see ``nested.data.corpus``), read through ``grain``.

Stream: a split's shards memory-mapped (``numpy.memmap``) and concatenated in shard order, so
the documents follow each other, each ended by the EOS id. Windows: non-overlapping windows of
T + 1 tokens at stride T (window ``w`` is stream ``[w T, w T + T]``), ``(N - 1) // T`` of them
for a stream of N tokens (the tail that fills no window is left out); they straddle documents.

Order: ``train`` row ``r`` (row ``j`` of batch ``i`` is ``r = i B + j``) is in epoch
``e = r // W`` (W windows) at position ``p = r % W``, and reads window ``perm_e[p]``, ``perm_e``
grain's ``MapDataset.shuffle`` with seed ``seed + e`` (a lazy index permutation, nothing
materialised). ``val`` rows are windows in stream order (``r % W``), never shuffled. Batch ``i``
is therefore a pure function of ``(seed, split, i, B)`` and of the files: a resumed run reads
the same batches from the step of its checkpoint, and ``rows=`` reads only a process's rows.

Batch: ``inputs = w[:, :-1]``, ``targets = w[:, 1:]`` (B, T) int32, mask ones (every position,
across document boundaries too), extras ``documents`` (B, T) int32: the document of each input
position within its row, 0 at the row's first position, +1 after each EOS (the position after an
EOS starts a new document). Example (T = 6, EOS = 256): window ``104 105 256 111 107 256 97``
gives inputs ``104 105 256 111 107 256``, targets ``105 256 111 107 256 97``, documents
``0 0 0 1 1 1``.

Alignment (``align = A > 1``): the window is laid out by :func:`align_documents` before the
split into inputs and targets, so every document after the row's first begins at a multiple of
A, and cut back to T + 1; the mask is 0 where the target is a pad. With A = 4 the window above
becomes ``104 105 256 256 111 107 256``: inputs ``104 105 256 256 111 107``, targets ``105 256
256 111 107 256``, mask ``1 1 0 1 1 1``, documents ``0 0 0 0 1 1``; its last token ``97`` is
not read. The share of a split's tokens so skipped is about ``(A - 1) / 2`` per document over
the mean document length.

Checks, when the split is first read (one-line ``ValueError``): a folder without a valid
``index.json``, a shard missing or of the wrong size, a model ``vocab_size`` smaller than the
tokenizer's, a ``tokenizer_sha256`` that is not the index's, a split shorter than one window.
The shards' SHA-256 are checked by :meth:`TokensTask.verify` (a full read), not on every start.

Prefetch: ``batch`` itself is synchronous (a window is a memmap slice; the page cache does the
read-ahead); :meth:`TokensTask.prefetch` yields ``(i, batch(i))`` for i = start, start + 1, ...
from grain's ``to_iter_dataset`` with ``ReadOptions`` threads and a prefetch buffer, the same
batches as ``batch`` (the index API keeps the position: resume by starting at the next index).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from nested.data import corpus
from nested.data.batch import Batch, check_request, field_error, make_batch


def document_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """(B, T) int32 document index of each position of ``inputs`` (B, T) within its row: 0 at
    position 0, incremented where a token that is not EOS follows an EOS (so the EOS pads of
    :func:`align_documents` stay in the document they end)."""
    begins = (inputs[:, :-1] == eos_id) & (inputs[:, 1:] != eos_id)
    return np.concatenate(
        [
            np.zeros((inputs.shape[0], 1), np.int32),
            np.cumsum(begins, axis=1, dtype=np.int32),
        ],
        axis=1,
    )


def align_documents(tokens: np.ndarray, eos_id: int, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens (N,)``, documents each ended by EOS (the first may be the end of one), laid out
    so that every document after the first begins at a multiple of ``grid``: each document is
    followed by EOS pads up to the next multiple, ``start_k = sum_{j<k} grid * ceil(len_j /
    grid)``. Returns ``(aligned (M,), real (M,) bool)``, False at the pads; ``grid = 1`` gives
    ``tokens`` back."""
    ends = np.flatnonzero(tokens == eos_id) + 1  # where each document after the first begins
    ends = ends[ends < len(tokens)]
    lengths = np.diff(np.concatenate([[0], ends, [len(tokens)]]))
    starts = np.concatenate([[0], np.cumsum(-(-lengths[:-1] // grid) * grid)])
    position = (
        np.repeat(starts, lengths)
        + np.arange(len(tokens))
        - np.repeat(np.concatenate([[0], ends]), lengths)
    )
    size = int(starts[-1] + lengths[-1]) if len(tokens) else 0
    aligned = np.full(size, eos_id, tokens.dtype)
    real = np.zeros(size, bool)
    aligned[position], real[position] = tokens, True
    return aligned, real


class WindowSource:
    """grain ``RandomAccessDataSource`` of the windows of one split: ``source[w]`` is window
    ``w`` (T + 1,) int32 of the concatenated shards (memory-mapped, read on access)."""

    def __init__(self, shards: list[np.ndarray], seq_len: int):
        self.shards = shards
        self.seq_len = seq_len
        sizes = np.array([len(s) for s in shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # (S + 1,) stream offsets
        self.windows = max(int(self.starts[-1]) - 1, 0) // seq_len

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, w: int) -> np.ndarray:
        if not 0 <= w < self.windows:
            raise IndexError(f"window {w} out of range [0, {self.windows})")
        lo, hi = int(w) * self.seq_len, int(w) * self.seq_len + self.seq_len + 1
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        parts, k = [], first
        while lo < hi:
            offset = lo - int(self.starts[k])
            take = min(hi - lo, len(self.shards[k]) - offset)
            parts.append(self.shards[k][offset : offset + take])
            lo, k = lo + take, k + 1
        return np.concatenate(parts).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class TokensTask:
    """Packed LM windows of a prepared corpus; see the module docstring.

    Fields:
      path: the folder ``experiments/prepare.py`` wrote (``index.json`` and shards).
      seq_len: T, the input length of a training window.
      vocab_size: the model's vocabulary; at least the index's tokenizer ``vocab_size`` (257
        is the ``bytes`` tokenizer's; a BPE needs its own, e.g. 8192).
      seed: base seed; epoch e of ``train`` is shuffled with ``seed + e``.
      eval_seq_len: T of ``val`` windows; None = ``seq_len``.
      tokenizer_sha256: when set, the SHA-256 of the ``tokenizer.json`` the shards must come
        from (the index's ``tokenizer.sha256``; ``bytes`` has none).
      documents: give the batch its ``documents`` extra, so that every fast level restarts at
        each document start inside a window (False: documents are packed and the state flows
        across them, as ttt-lm-jax and most JAX trainers do; cheaper where a kernel lacks
        document starts and the generic loop would run).
      align: documents after a window's first begin at multiples of ``align`` positions (EOS
        pads after each document, never scored; the raw window's tokens pushed past T are not
        read): a model whose schedule keeps a grid of the row (CMS spans, memory-as-context
        segments) then runs each document exactly as alone, and a mini-batch kernel once a
        chunk. None: 1 here; an experiment sets it to its model's grid
        (``nested.run.config.document_grid``).

    Extras: ``documents`` (B, T) int32 (with ``documents=True``), see :func:`document_ids`.
    """

    path: str | None = None
    seq_len: int = 256
    vocab_size: int = 257
    seed: int = 0
    eval_seq_len: int | None = None
    tokenizer_sha256: str | None = None
    documents: bool = True
    align: int | None = None

    name: ClassVar[str] = "tokens"
    eval_splits: ClassVar[tuple[str, ...]] = ("val",)

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(self.name, "seed", self.seed, "use a non-negative int")
        for field in ("seq_len", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise field_error(self.name, field, value, "use a positive int")
        if self.eval_seq_len is not None and self.eval_seq_len < 1:
            raise field_error(self.name, "eval_seq_len", self.eval_seq_len, "use a positive int")
        if not isinstance(self.documents, bool):
            raise field_error(self.name, "documents", self.documents, "use True or False")
        if self.align is not None and (not isinstance(self.align, int) or self.align < 1):
            raise field_error(self.name, "align", self.align, "use a positive int (1: none)")

    @property
    def document_grid(self) -> int:
        """Where the documents of every row start: at multiples of this many positions (its
        ``align``, down to the divisor it shares with the window lengths, since evaluation cuts
        windows from one aligned stream); 1 without ``documents``. A program compiled with it
        (``nested.compile(..., document_grid=)``) restarts its ops only at chunk starts."""
        if not self.documents:
            return 1
        return math.gcd(self.align or 1, self.seq_len, self.split_seq_len("val"))

    def split_seq_len(self, split: str) -> int:
        """T of ``split``'s windows."""
        return self.seq_len if split == "train" else (self.eval_seq_len or self.seq_len)

    def text_tokenizer(self) -> corpus.Tokenizer:
        """The tokenizer the corpus was prepared with (:func:`corpus.prepared_tokenizer`)."""
        return corpus.prepared_tokenizer(self.path, self.index)

    @functools.cached_property
    def index(self) -> dict[str, Any]:
        """The folder's ``index.json``, checked against the task's fields."""
        if self.path is None:
            raise ValueError(
                f"{self.name}: path is not set; give the folder experiments/prepare.py wrote"
            )
        file = Path(self.path) / corpus.INDEX
        try:
            index = json.loads(file.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"{self.name}: path={self.path!r} has no {corpus.INDEX}; prepare it with "
                f"python experiments/prepare.py --input TEXT --out {self.path}"
            ) from None
        except (OSError, ValueError) as error:
            raise ValueError(
                f"{self.name}: {file} cannot be read ({error}); prepare the folder again"
            ) from None
        if not isinstance(index, dict) or index.get("format") != corpus.FORMAT:
            raise ValueError(
                f"{self.name}: {file} is not format {corpus.FORMAT!r}; prepare the folder again "
                "with experiments/prepare.py"
            )
        tok = index["tokenizer"]
        if tok["vocab_size"] > self.vocab_size:
            raise ValueError(
                f"{self.name}: vocab_size={self.vocab_size} is smaller than the tokenizer's "
                f"vocab_size={tok['vocab_size']} ({file}); set task.vocab_size >= "
                f"{tok['vocab_size']}"
            )
        if self.tokenizer_sha256 is not None and self.tokenizer_sha256 != tok["sha256"]:
            raise ValueError(
                f"{self.name}: the shards of {self.path!r} come from tokenizer sha256="
                f"{tok['sha256']}, the config says tokenizer_sha256={self.tokenizer_sha256}; "
                "prepare the corpus with the config's tokenizer or fix the config"
            )
        return index

    @property
    def eos_id(self) -> int:
        """The end-of-document id of the corpus."""
        return int(self.index["tokenizer"]["eos_id"])

    def _shards(self, split: str) -> list[np.ndarray]:
        dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        shards = []
        for shard in self.index["splits"][split]["shards"]:
            file = Path(self.path) / shard["file"]
            size = file.stat().st_size if file.is_file() else None
            if size != shard["tokens"] * dtype.itemsize:
                found = "missing" if size is None else f"{size} bytes"
                raise ValueError(
                    f"{self.name}: shard {file} is {found}, the index says "
                    f"{shard['tokens'] * dtype.itemsize} bytes; prepare the folder again"
                )
            shards.append(np.memmap(file, dtype=dtype, mode="r"))
        return shards

    @functools.cached_property
    def _memo(self) -> dict:
        return {}  # per instance: ("source", split) -> WindowSource, ("epoch", split, e) -> data

    def source(self, split: str) -> WindowSource:
        """The windows of ``split`` (checked: at least one)."""
        if ("source", split) in self._memo:
            return self._memo["source", split]
        source = WindowSource(self._shards(split), self.split_seq_len(split))
        if len(source) < 1:
            t = self.split_seq_len(split)
            raise ValueError(
                f"{self.name}: the {split} split of {self.path!r} has "
                f"{self.index['splits'][split]['tokens']} tokens, fewer than one window of "
                f"T + 1 = {t + 1}; give a larger corpus (or val_fraction) or a smaller T"
            )
        self._memo["source", split] = source
        return source

    def _epoch(self, split: str, epoch: int):
        key = ("epoch", split, epoch)
        if key not in self._memo:
            import grain  # deferred: grain takes seconds to import

            dataset = grain.MapDataset.source(self.source(split))
            if split == "train":
                dataset = dataset.shuffle(seed=self.seed + epoch)
            self._memo[key] = dataset
        return self._memo[key]

    def window(self, split: str, row: int) -> np.ndarray:
        """(T + 1,) int32: the window of global row ``row`` of ``split`` (module docstring)."""
        n = len(self.source(split))
        epoch, position = divmod(int(row), n)
        return self._epoch(split, epoch if split == "train" else 0)[position]

    def batch(
        self, index: int, batch_size: int, *, split: str = "train", rows: slice | None = None
    ) -> Batch:
        """Batch ``index`` of ``split`` (B rows; of them only ``rows`` when given): inputs,
        targets, mask (B, T), extras ``documents`` (B, T) (with ``documents=True``)."""
        check_request(self, index, batch_size, split)
        global_rows = range(index * batch_size, (index + 1) * batch_size)
        if rows is not None:
            global_rows = global_rows[rows]
        t = self.split_seq_len(split)
        windows = np.stack([self.window(split, r) for r in global_rows]).reshape(-1, t + 1)
        real = np.ones(windows.shape, bool)
        if (self.align or 1) > 1:
            laid = [align_documents(w, self.eos_id, self.align) for w in windows]
            windows = np.stack([w[: t + 1] for w, _ in laid]).reshape(-1, t + 1)
            real = np.stack([r[: t + 1] for _, r in laid]).reshape(-1, t + 1)
        inputs = windows[:, :-1]
        extras = {"documents": document_ids(inputs, self.eos_id)} if self.documents else {}
        return make_batch(inputs, windows[:, 1:], real[:, 1:].astype(np.float32), **extras)

    def prefetch(
        self,
        start: int,
        batch_size: int,
        *,
        split: str = "train",
        rows: slice | None = None,
        threads: int = 2,
        buffer: int = 4,
    ) -> Iterator[tuple[int, Batch]]:
        """``(i, batch(i, ...))`` for i = start, start + 1, ..., made ahead by ``threads`` grain
        threads, up to ``buffer`` batches."""
        import grain

        make = lambda i: (i, self.batch(i, batch_size, split=split, rows=rows))
        counter = grain.MapDataset.source(_Counter(start)).map(make)
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=buffer)
        return iter(counter.to_iter_dataset(options))

    def verify(self) -> None:
        """Re-hash every shard against the index (a full read); ``ValueError`` naming the first
        that differs."""
        for split in corpus.SPLITS:
            for shard in self.index["splits"][split]["shards"]:
                file = Path(self.path) / shard["file"]
                if corpus.sha256_file(file) != shard["sha256"]:
                    raise ValueError(
                        f"{self.name}: shard {file} does not match its sha256 in the index; "
                        "prepare the folder again"
                    )

    def describe(self) -> str:
        try:
            tok = self.index["tokenizer"]
            counts = ", ".join(
                f"{s} {self.index['splits'][s]['documents']} documents / "
                f"{self.index['splits'][s]['tokens']} tokens"
                for s in corpus.SPLITS
            )
            about = f"{tok['kind']} tokenizer (vocab {tok['vocab_size']}, EOS {tok['eos_id']}); "
            about += counts
        except ValueError as error:
            about = f"not readable yet: {error}"
        return (
            f"Packed LM on the prepared corpus {self.path} ({about}); documents concatenated "
            f"with EOS after each, windows of T={self.seq_len} + 1 tokens at stride T, train "
            f"shuffled per epoch (grain, seed {self.seed} + epoch), val in order (T="
            f"{self.split_seq_len('val')}); inputs = w[:-1], targets = w[1:], every position "
            "scored, extras documents: the document of each position within its row"
            + (
                f"; every document after a row's first starts at a multiple of {self.align} "
                "(EOS pads, not scored)"
                if (self.align or 1) > 1
                else ""
            )
            + ".\n"
            "Example (EOS 256): window 104 105 256 111 107 256 97 -> inputs 104 105 256 111 107 "
            "256, targets 105 256 111 107 256 97, documents 0 0 0 1 1 1."
        )


class _Counter:
    """grain source of the batch indices start, start + 1, ... (practically unbounded)."""

    def __init__(self, start: int):
        self.start = start

    def __len__(self) -> int:
        return 1 << 62

    def __getitem__(self, i: int) -> int:
        return self.start + int(i)
