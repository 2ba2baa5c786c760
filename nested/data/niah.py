"""Single needle in a haystack (S-NIAH, after the passkey/needle tasks of RULER, Hsieh et al. 2024).

A stream s of T + 1 tokens is built, the model reads ``inputs = s[:T]`` and predicts
``targets = s[1:]`` (next-token), scored only on the answer:

    x x x x NEEDLE k_1 k_2 v_1 v_2 x x x x ... x x | QUERY k_1 k_2 v_1 v_2
    \\______ haystack of noise with the needle at depth d _______/ \\______ tail ______/

* tokens 0, 1, 2 are reserved: 0 padding/unused, 1 ``NEEDLE`` marker, 2 ``QUERY`` marker;
* key tokens come from [3, mid) and value tokens from [mid, V), mid = 3 + (V - 3) // 2;
  noise tokens are uniform over [3, V) (so they may look like keys and values: only the
  marker tells the needle apart);
* the needle ``NEEDLE k_1..k_m v_1..v_n`` is inserted into the noise at depth d, uniform in
  [0, 1] (the fraction of noise before it); with ``num_distractors`` = D > 0, D more needles
  with other keys are inserted at independent depths and the query asks one of the 1 + D at
  random (multi-key NIAH; the default D = 0 is the single-needle task);
* the tail ``QUERY k_1..k_m v_1..v_n`` repeats the key; the n scored positions are those
  whose next token is a value token (the last key token and v_1..v_{n-1}), with teacher
  forcing inside the answer. A sequence is solved when all n are right.

Splits: ``train`` at ``seq_len``; ``len{L}`` for each L in ``eval_lengths`` (report accuracy
by context length). Extras: ``depth`` (B,) float32, the depth of the asked needle, and
``needle_pos`` (B,) int32, the input position of its ``NEEDLE`` marker.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from nested.data.batch import (
    Batch,
    check_request,
    field_error,
    make_batch,
    render_example,
    rng_for,
    sample_without_replacement,
)

NEEDLE = 1
QUERY = 2
FIRST_CONTENT = 3


@dataclasses.dataclass(frozen=True)
class NIAHTask:
    """Needle-in-a-haystack retrieval by context length; see the module docstring.

    Fields:
      vocab_size: V, with 3 reserved tokens, keys in [3, mid), values in [mid, V).
      seq_len: input length T of training batches.
      eval_lengths: input lengths of the held-out splits ``len{L}``.
      key_len: m, key tokens per needle.
      value_len: n, value tokens per needle (the scored answer).
      num_distractors: D, extra needles with other keys (0: single needle).
      seed: base seed; batch ``i`` of split ``s`` depends on (seed, s, i) only.
    """

    vocab_size: int = 8192
    seq_len: int = 256
    eval_lengths: tuple[int, ...] = (256, 512, 1024)
    key_len: int = 2
    value_len: int = 2
    num_distractors: int = 0
    seed: int = 0

    name: ClassVar[str] = "niah"

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(self.name, "seed", self.seed, "use a non-negative int")
        for field in ("key_len", "value_len"):
            if getattr(self, field) < 1:
                raise field_error(self.name, field, getattr(self, field), "use at least 1 token")
        if self.num_distractors < 0:
            raise field_error(self.name, "num_distractors", self.num_distractors, "use >= 0")
        needed_keys = self._num_needles * self.key_len
        if self._mid - FIRST_CONTENT < needed_keys or self._mid >= self.vocab_size:
            raise field_error(
                self.name,
                "vocab_size",
                self.vocab_size,
                f"{self._num_needles} needles of {self.key_len} distinct key tokens need "
                f"vocab_size >= {FIRST_CONTENT + 2 * needed_keys}",
            )
        if len(self.eval_lengths) == 0 or len(set(self.eval_lengths)) != len(self.eval_lengths):
            raise field_error(self.name, "eval_lengths", self.eval_lengths, "give distinct lengths")
        for field, length in [("seq_len", self.seq_len)] + [
            ("eval_lengths", n) for n in self.eval_lengths
        ]:
            if length < self.min_length:
                raise field_error(
                    self.name,
                    field,
                    length,
                    f"{self._num_needles} needle(s) and the query tail of {self._needle_len} "
                    f"tokens each need length >= {self.min_length}",
                )

    @property
    def _mid(self) -> int:
        return FIRST_CONTENT + (self.vocab_size - FIRST_CONTENT) // 2

    @property
    def _num_needles(self) -> int:
        return 1 + self.num_distractors

    @property
    def _needle_len(self) -> int:
        return 1 + self.key_len + self.value_len

    @property
    def min_length(self) -> int:
        """Shortest valid input length T: needles and tail fill all of T + 1 tokens but one."""
        return (self._num_needles + 1) * self._needle_len

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return tuple(f"len{n}" for n in self.eval_lengths)

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch ``index`` of ``split``: (B, T) with T = seq_len or the split's length."""
        check_request(self, index, batch_size, split)
        rng = rng_for(self.seed, split, int(index))
        length = self.seq_len if split == "train" else int(split.removeprefix("len"))
        return self._sequences(rng, batch_size, length)

    def _sequences(self, rng: np.random.Generator, rows: int, length: int) -> Batch:
        needles, m, n = self._num_needles, self.key_len, self.value_len
        hay = length + 1 - needles * self._needle_len - self._needle_len
        noise = rng.integers(FIRST_CONTENT, self.vocab_size, size=(rows, hay))
        keys = FIRST_CONTENT + sample_without_replacement(
            rng, self._mid - FIRST_CONTENT, needles * m, rows=rows
        ).reshape(rows, needles, m)
        values = rng.integers(self._mid, self.vocab_size, size=(rows, needles, n))
        cuts = np.sort(rng.integers(0, hay + 1, size=(rows, needles)), axis=1)
        asked = rng.integers(0, needles, size=rows)

        stream = np.empty((rows, length + 1), dtype=np.int64)
        for r in range(rows):
            pieces, start = [], 0
            for j in range(needles):
                pieces += [noise[r, start : cuts[r, j]], [NEEDLE], keys[r, j], values[r, j]]
                start = cuts[r, j]
            pieces += [noise[r, start:], [QUERY], keys[r, asked[r]], values[r, asked[r]]]
            stream[r] = np.concatenate(pieces)
        mask = np.zeros((rows, length), dtype=np.float32)
        mask[:, length - n :] = 1.0
        rank = np.arange(rows)
        return make_batch(
            stream[:, :-1],
            stream[:, 1:] * (mask > 0),
            mask,
            depth=(cuts[rank, asked] / hay).astype(np.float32),
            needle_pos=(cuts[rank, asked] + asked * self._needle_len).astype(np.int32),
        )

    def describe(self) -> str:
        small = dataclasses.replace(self, vocab_size=64, seq_len=self.min_length + 8)
        example = render_example(small._sequences(np.random.default_rng(0), 1, small.seq_len))
        return (
            f"S-NIAH: V={self.vocab_size}, train T={self.seq_len}, eval lengths "
            f"{list(self.eval_lengths)}, key {self.key_len} + value {self.value_len} tokens, "
            f"{self.num_distractors} distractor needle(s).\n"
            f"Noise in [3, V) with NEEDLE={NEEDLE} k.. v.. at a random depth; the tail "
            f"QUERY={QUERY} k.. asks for v.. (next-token targets, only the answer scored).\n"
            f"Example (V=64, T={small.seq_len}):\n{example}"
        )
