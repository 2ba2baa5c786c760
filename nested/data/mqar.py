"""Multi-query associative recall (MQAR), as in the Zoology benchmark.

Arora, Eyuboglu et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models". A sequence of length T with P key-value pairs is laid out as

    k_1 v_1 k_2 v_2 ... k_P v_P | x x k_3 x x x k_1 x ... x k_2 x ...
    \\_____ 2P tokens ________/   \\___ T - 2P query region _______/

* keys are P distinct tokens of [1, V//2), values P distinct tokens of [V//2, V);
* the query region holds ``space = (T - 2P) // 2`` slots at even offsets 0, 2, 4, ...; each
  key is queried once, at the slot ``g`` of a draw of P distinct slots made without
  replacement with P(g) proportional to (g + 1)^(a - 1) (``power_a`` = a; a = 1 is uniform,
  small a puts queries near the pairs, mimicking the power-law gaps between repeated bigrams);
* the target at a query's position is the value paired with that key (the value itself is not
  fed after the query); every other position is filler, a uniform token of [0, V) when
  ``random_non_queries`` (Zoology's default), else 0, and is not scored (mask 0);
* so each sequence has exactly P scored positions, one per key.

Validity (Zoology's): 2P (pairs) + 2P (query slots) <= T, and P <= V//2 - 1 distinct keys.

Curriculum (Zoology's defaults): train on a mixture of (T, P) settings, test on each setting
separately. A training batch draws a setting per row (probabilities ``train_weights``,
uniform by default; Zoology's example mixture is 100k rows of (64, 4) and 20k of each other
setting, i.e. weights (5, 1, 1, 1, 1)) and right-pads shorter rows to the longest train
length with input 0, target 0, mask 0. Test split ``seq{T}_kv{P}`` has that setting's own
length, unpadded.
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

ZOOLOGY_TRAIN_SETTINGS = ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64))
ZOOLOGY_TEST_SETTINGS = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128))


def mqar_sequences(
    rng: np.random.Generator,
    rows: int,
    *,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    power_a: float,
    random_non_queries: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draws ``rows`` MQAR sequences of one setting: inputs, targets, mask, each (rows, T).

    Arguments are assumed valid (``MQARTask`` checks them).
    """
    pairs, half = num_kv_pairs, vocab_size // 2
    context = 2 * pairs
    keys = 1 + sample_without_replacement(rng, half - 1, pairs, rows=rows)
    values = half + sample_without_replacement(rng, vocab_size - half, pairs, rows=rows)
    space = (seq_len - context) // 2
    gap_weights = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    gaps = sample_without_replacement(rng, space, pairs, rows=rows, weights=gap_weights)

    if random_non_queries:
        inputs = rng.integers(0, vocab_size, size=(rows, seq_len))
    else:
        inputs = np.zeros((rows, seq_len), dtype=np.int64)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    query_pos = context + 2 * gaps
    np.put_along_axis(inputs, query_pos, keys, axis=1)
    targets = np.zeros((rows, seq_len), dtype=np.int64)
    np.put_along_axis(targets, query_pos, values, axis=1)
    mask = np.zeros((rows, seq_len), dtype=np.float32)
    np.put_along_axis(mask, query_pos, 1.0, axis=1)
    return inputs, targets, mask


def _split_name(setting: tuple[int, int]) -> str:
    return f"seq{setting[0]}_kv{setting[1]}"


@dataclasses.dataclass(frozen=True)
class MQARTask:
    """MQAR over a mixture of (seq_len, num_kv_pairs) settings; see the module docstring.

    Fields:
      vocab_size: V; keys come from [1, V//2), values from [V//2, V).
      train_settings: (seq_len, num_kv_pairs) pairs mixed in training batches.
      test_settings: one held-out split ``seq{T}_kv{P}`` per pair.
      train_weights: relative frequency of each train setting (None: uniform).
      power_a: exponent a of the query-gap law P(g) ~ (g + 1)^(a - 1), a > 0.
      random_non_queries: filler tokens uniform in [0, V) (True) or 0 (False).
      seed: base seed; batch ``i`` of split ``s`` depends on (seed, s, i) only.

    Extras of every batch: ``seq_len`` (B,) int32 and ``num_kv_pairs`` (B,) int32, the
    setting of each row (group by them to report accuracy per setting); positions at or
    beyond a row's ``seq_len`` are padding.
    """

    vocab_size: int = 8192
    train_settings: tuple[tuple[int, int], ...] = ZOOLOGY_TRAIN_SETTINGS
    test_settings: tuple[tuple[int, int], ...] = ZOOLOGY_TEST_SETTINGS
    train_weights: tuple[float, ...] | None = None
    power_a: float = 0.01
    random_non_queries: bool = True
    seed: int = 0

    name: ClassVar[str] = "mqar"

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise field_error(self.name, "seed", self.seed, "use a non-negative int")
        if not self.power_a > 0:
            raise field_error(self.name, "power_a", self.power_a, "use a > 0 (1.0 = uniform)")
        for field in ("train_settings", "test_settings"):
            settings = getattr(self, field)
            if len(settings) == 0:
                raise field_error(self.name, field, settings, "give at least one (seq_len, pairs)")
            for setting in settings:
                self._check_setting(field, setting)
        names = [_split_name(s) for s in self.test_settings]
        if len(set(names)) != len(names):
            raise field_error(self.name, "test_settings", self.test_settings, "remove duplicates")
        if self.train_weights is not None:
            w = np.asarray(self.train_weights, dtype=np.float64)
            if w.shape != (len(self.train_settings),) or (w < 0).any() or w.sum() <= 0:
                raise field_error(
                    self.name,
                    "train_weights",
                    self.train_weights,
                    f"give {len(self.train_settings)} non-negative weights (one per train "
                    "setting) with a positive sum, or None for uniform",
                )

    def _check_setting(self, field: str, setting) -> None:
        if len(setting) != 2:
            raise field_error(self.name, field, setting, "each entry is (seq_len, num_kv_pairs)")
        seq_len, pairs = setting
        if pairs < 1:
            raise field_error(self.name, f"{field}.num_kv_pairs", pairs, "use at least 1 pair")
        if 4 * pairs > seq_len:
            raise field_error(
                self.name,
                f"{field}.seq_len",
                seq_len,
                f"{pairs} pairs need 2*{pairs} pair tokens + 2*{pairs} query slots = "
                f"{4 * pairs} <= seq_len; raise seq_len or lower num_kv_pairs",
            )
        if pairs > self.vocab_size // 2 - 1:
            raise field_error(
                self.name,
                "vocab_size",
                self.vocab_size,
                f"{pairs} distinct keys need vocab_size // 2 - 1 >= {pairs}, "
                f"i.e. vocab_size >= {2 * pairs + 2}",
            )

    @property
    def seq_len(self) -> int:
        """Padded length of training batches: the longest train setting."""
        return max(t for t, _ in self.train_settings)

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return tuple(_split_name(s) for s in self.test_settings)

    def batch(self, index: int, batch_size: int, *, split: str = "train") -> Batch:
        """Batch ``index`` of ``split``: train mixes settings (padded), test splits do not."""
        check_request(self, index, batch_size, split)
        rng = rng_for(self.seed, split, int(index))
        if split == "train":
            settings = self.train_settings
            p = None
            if self.train_weights is not None:
                p = np.asarray(self.train_weights, dtype=np.float64)
                p = p / p.sum()
            which = rng.choice(len(settings), size=batch_size, p=p)
        else:
            settings = (self.test_settings[self.eval_splits.index(split)],)
            which = np.zeros(batch_size, dtype=np.int64)
        width = self.seq_len if split == "train" else settings[0][0]
        inputs = np.zeros((batch_size, width), dtype=np.int64)
        targets = np.zeros((batch_size, width), dtype=np.int64)
        mask = np.zeros((batch_size, width), dtype=np.float32)
        for s in np.unique(which):
            rows = np.flatnonzero(which == s)
            seq_len, pairs = settings[s]
            x, y, m = mqar_sequences(
                rng,
                rows.size,
                vocab_size=self.vocab_size,
                seq_len=seq_len,
                num_kv_pairs=pairs,
                power_a=self.power_a,
                random_non_queries=self.random_non_queries,
            )
            inputs[rows, :seq_len], targets[rows, :seq_len], mask[rows, :seq_len] = x, y, m
        table = np.asarray(settings, dtype=np.int32)
        return make_batch(
            inputs, targets, mask, seq_len=table[which, 0], num_kv_pairs=table[which, 1]
        )

    def describe(self) -> str:
        rng = np.random.default_rng(0)
        x, y, m = mqar_sequences(
            rng,
            1,
            vocab_size=32,
            seq_len=20,
            num_kv_pairs=3,
            power_a=self.power_a,
            random_non_queries=self.random_non_queries,
        )
        example = render_example(make_batch(x, y, m))
        return (
            f"MQAR (Zoology): V={self.vocab_size}, power_a={self.power_a}, "
            f"train mixture {list(self.train_settings)} padded to T={self.seq_len}, "
            f"test splits {list(self.eval_splits)}.\n"
            "Pairs k v (keys in [1, V/2), values in [V/2, V)), then each key queried once at a "
            "power-law distance; target at a query = its value; only queries are scored.\n"
            f"Example (V=32, T=20, 3 pairs):\n{example}"
        )
