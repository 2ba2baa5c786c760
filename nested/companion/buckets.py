"""The sizes a companion's jitted calls run at, so that a call never compiles anew for each
batch size or length.

Agents' states are gathered into a slab (rows = agents), padded to a power of two rows with
fresh states (their results discarded; :func:`slab`). An observe is cut into pieces whose
lengths are powers of two times the model's update period, largest first, run one after
another (:func:`pieces`: a stream cut at period boundaries continues exactly). Queries are
padded at the end to a power of two, rounded up to a multiple of the period
(:func:`query_length`: a causal model's read at a query's last token does not see what
follows). :func:`sizes` lists every size a request can make.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from nested.companion.inputs import MAX_QUERY_TOKENS, MAX_TOKENS


def pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def pieces(n: int, period: int) -> list[int]:
    """``n`` tokens (a multiple of ``period``) as lengths ``period * 2^j``, largest first: the
    binary digits of ``n / period``."""
    units, out, size = n // period, [], 1
    while units:
        if units & 1:
            out.append(size * period)
        units >>= 1
        size <<= 1
    return out[::-1]


def query_length(longest: int, period: int) -> int:
    """The padded length of queries whose longest has ``longest`` tokens."""
    return -(-pow2(longest) // period) * period


def slab(states: list, fresh: Any) -> Any:
    """One-row ``states`` stacked, padded with ``fresh`` to a power of two rows."""
    rows = states + [fresh] * (pow2(len(states)) - len(states))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *rows)


def row(slab_: Any, i: int) -> Any:
    """Row ``i`` of a slab, as a one-row state."""
    return jax.tree.map(lambda x: x[i : i + 1], slab_)


def sizes(max_batch: int, period: int) -> list[tuple[str, int, int]]:
    """Every ``(kind, rows, length)`` a request can make, cheapest first: rows a power of two
    up to the one ``max_batch`` pads to; observe pieces of ``period * 2^j`` tokens up to
    :data:`MAX_TOKENS`, recall lengths :func:`query_length` up to :data:`MAX_QUERY_TOKENS`."""
    rows = sorted({pow2(n) for n in range(1, max_batch + 1)})
    observe = [period << j for j in range(MAX_TOKENS.bit_length())]
    observe = [n for n in observe if n <= MAX_TOKENS]
    recall = {query_length(n, period) for n in range(1, MAX_QUERY_TOKENS + 1)}
    out = [("observe", r, n) for r in rows for n in observe]
    out += [("recall", r, n) for r in rows for n in sorted(recall)]
    return sorted(out, key=lambda size: (size[1] * size[2], size[0]))
