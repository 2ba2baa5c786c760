"""Character-level (byte-level) language modelling on real text, nothing downloaded.

Vocabulary: the 256 byte values. Bytes need no vocabulary file, cannot meet an unknown
character, and read any file, UTF-8 or not (a Latin-1 or KOI8-R source is just bytes); for
ASCII text (most Python source) a byte is a character, so bits per byte is bits per character.

Corpus: by default the ``*.py`` files of the Python standard library of the running
interpreter (``sysconfig.get_paths()["stdlib"]``, minus ``site-packages``/``dist-packages``),
or any text file or folder given as ``path`` (a folder is read recursively with ``glob``).
Files are sorted by relative path and concatenated as they are (no separator).

Held-out split by file: file f goes to validation when h(f) < ``val_fraction``, h(f) = the
first 8 bytes of SHA-256 of its relative path read as a fraction in [0, 1). The split is
stable (it does not move when files are added elsewhere) and files are never shared. If no
file (or every file) falls below the threshold, the file(s) with the smallest h are moved so
each side has at least one (a folder needs 2 files). A single file given as ``path`` is split
by bytes instead: its last ``val_fraction`` goes to validation. Each split needs at least one
window (T + 1 bytes), else ``ValueError`` naming the path and that minimum. The default
corpus depends on the interpreter's version (its standard library).

Batches: B windows of T + 1 bytes at offsets uniform over the split's bytes, drawn from
(seed, split, index); ``inputs = w[:, :-1]``, ``targets = w[:, 1:]``, mask all ones. Windows
may straddle two files. Splits: ``train`` and ``val``.

Example (T = 8): window ``b"def f(x)"`` + ``b":"`` gives inputs ``100 101 102 32 102 40 120 41``
and targets ``101 102 32 102 40 120 41 58``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import sysconfig
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

from nested.data.batch import Batch, check_request, field_error, make_batch, rng_for

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def bits_per_char(mean_nats: float | np.ndarray) -> float | np.ndarray:
    """Bits per character (byte) from the mean next-token cross-entropy in nats: nats / ln 2."""
    return mean_nats / math.log(2.0)


def decode(tokens: np.ndarray) -> str:
    """Bytes to text for display; invalid UTF-8 shows as U+FFFD."""
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def _file_fraction(relative: str) -> float:
    digest = hashlib.sha256(relative.encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_files(relatives: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) relative paths, each sorted: val = h(f) < val_fraction, both non-empty."""
    ranked = sorted(relatives, key=_file_fraction)
    n_val = sum(_file_fraction(rel) < val_fraction for rel in relatives)
    n_val = min(max(n_val, 1), len(relatives) - 1)
    return sorted(ranked[n_val:]), sorted(ranked[:n_val])


class _Corpus(NamedTuple):
    data: dict[str, np.ndarray]  # split -> uint8 bytes
    files: dict[str, tuple[str, ...]]  # split -> relative paths (the file name for one file)


@dataclasses.dataclass(frozen=True)
class CharLMTask:
    """Byte-level LM on a text corpus; see the module docstring.

    Fields:
      path: a text file or a folder; None = the standard library sources.
      glob: file pattern inside a folder, searched recursively; None = ``*.py`` for the
        standard library, ``*`` (every file) for a given folder.
      seq_len: T, the input length of every window.
      val_fraction: share of files (or of bytes, for a single file) held out, in (0, 1).
      seed: base seed; batch ``i`` of split ``s`` depends on (seed, s, i) only.

    The corpus is read on first use (about 0.5 s for the 30 MB standard library) and kept
    on the instance. Extras: none.
    """

    path: str | None = None
    glob: str | None = None
    seq_len: int = 256
    val_fraction: float = 0.05
    seed: int = 0

    name: ClassVar[str] = "char_lm"
    vocab_size: ClassVar[int] = 256
    eval_splits: ClassVar[tuple[str, ...]] = ("val",)

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(self.name, "seed", self.seed, "use a non-negative int")
        if self.seq_len < 1:
            raise field_error(self.name, "seq_len", self.seq_len, "use a positive length")
        if not 0.0 < self.val_fraction < 1.0:
            raise field_error(self.name, "val_fraction", self.val_fraction, "use 0 < f < 1")

    @property
    def root(self) -> Path:
        """The corpus file or folder."""
        return Path(self.path) if self.path is not None else Path(sysconfig.get_paths()["stdlib"])

    def split_bytes(self, split: str) -> np.ndarray:
        """The bytes of ``split`` ("train" or "val") as a uint8 array."""
        return self._corpus.data[split]

    def split_files(self, split: str) -> tuple[str, ...]:
        """Relative paths of the files of ``split`` (a single-file corpus: its name, both)."""
        return self._corpus.files[split]

    @functools.cached_property
    def _corpus(self) -> _Corpus:
        try:
            return self._read()
        except OSError as error:  # unreadable files, a folder that cannot be listed
            raise ValueError(
                f"{self.name}: path={str(self.root)!r} cannot be read: {error.strerror} "
                f"({error.filename}); give a readable text file or folder"
            ) from error

    def _read(self) -> _Corpus:
        root = self.root
        if root.is_file():
            raw = np.frombuffer(root.read_bytes(), dtype=np.uint8)
            cut = len(raw) - math.ceil(self.val_fraction * len(raw))
            data = {"train": raw[:cut], "val": raw[cut:]}
            files = {"train": (root.name,), "val": (root.name,)}
        elif root.is_dir():
            pattern = self.glob or ("*.py" if self.path is None else "*")
            paths = {
                f.relative_to(root).as_posix(): f
                for f in root.rglob(pattern)
                if f.is_file() and not _SKIPPED_DIRS.intersection(f.relative_to(root).parts)
            }
            if len(paths) < 2:
                raise ValueError(
                    f"{self.name}: path={str(root)!r} has {len(paths)} file(s) matching "
                    f"glob={pattern!r}; a folder needs at least 2 (one per split) and "
                    f"seq_len + 1 = {self.seq_len + 1} bytes per split: add files, change "
                    "glob, or point path at a single file (split by bytes)"
                )
            train, val = split_files(list(paths), self.val_fraction)
            files = {"train": tuple(train), "val": tuple(val)}
            data = {
                split: np.frombuffer(b"".join(paths[f].read_bytes() for f in names), np.uint8)
                for split, names in files.items()
            }
        elif root.exists():
            raise ValueError(f"{self.name}: path={str(root)!r} is neither a file nor a folder")
        else:
            raise ValueError(
                f"{self.name}: path={str(root)!r} does not exist; give a text file or a folder"
            )
        for split, split_data in data.items():
            if len(split_data) < self.seq_len + 1:
                raise ValueError(
                    f"{self.name}: the {split} split of path={str(root)!r} has {len(split_data)} "
                    f"bytes, fewer than one window of seq_len + 1 = {self.seq_len + 1} bytes; "
                    "give a larger corpus, a smaller seq_len, or (for val) a larger val_fraction"
                )
        return _Corpus(data, files)

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch ``index`` of ``split``: B random windows, inputs and targets (B, T)."""
        check_request(self, index, batch_size, split)
        data = self.split_bytes(split)
        rng = rng_for(self.seed, split, int(index))
        starts = rng.integers(0, len(data) - self.seq_len, size=batch_size)
        windows = data[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]
        mask = np.ones((batch_size, self.seq_len), dtype=np.float32)
        return make_batch(windows[:, :-1], windows[:, 1:], mask)

    def describe(self) -> str:
        if self.root.is_file():
            corpus = f"{self.root}, its last {self.val_fraction:.0%} of bytes held out as 'val'"
        else:
            corpus = (
                f"{self.root} (glob {self.glob!r}), {self.val_fraction:.0%} of files held out "
                "as 'val' by path hash"
            )
        return (
            f"Byte-level LM (vocab 256) on {corpus}; windows of "
            f"T={self.seq_len} + 1 bytes, inputs = w[:-1], targets = w[1:], every position "
            "scored.\n"
            "Example: b'def f(x):' -> inputs 100 101 102 32 102 40 120 41, "
            "targets 101 102 32 102 40 120 41 58."
        )
