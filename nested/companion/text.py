"""Text for a companion: the tokenizer it takes text with, and a text's checked encoding.

Where the companion has a tokenizer (``"bytes"``, the path of a ``tokenizer.json``, or by
default the run's own: its corpus's ``tokenizer.json`` (``nested.data.TokensTask``) or the
text companion task's words (``CompanionTask(text=True)``)), an observation or a query may be
a string instead of token ids: it is encoded without the tokenizer's special tokens and held
to the same limits, counted in tokens, and a recall also answers each predicted token decoded.
Text given to a companion without a tokenizer is refused (422).
"""

from __future__ import annotations

import numpy as np

from nested.companion.inputs import CompanionError
from nested.data import corpus


def run_tokenizer(task, vocab: int, given: str | None = None) -> corpus.Tokenizer | None:
    """The tokenizer a companion takes text with (:func:`nested.data.corpus.run_tokenizer`:
    ``given`` ``"bytes"`` or a ``tokenizer.json``; None: the run's ``task``'s own, or None); a
    :class:`CompanionError` naming ``--tokenizer`` when it cannot be read or is too large."""
    where = f"--tokenizer={given}" if given else f"the run's task ({task.name}) tokenizer"
    try:
        return corpus.run_tokenizer(task, vocab, given)
    except ValueError as error:  # corpus.PrepareError, a task's own error
        raise CompanionError(
            f"{where}: {error}; serve with --tokenizer=bytes or the tokenizer.json the run "
            "trained with"
        ) from None


def encode_text(
    tokenizer: corpus.Tokenizer | None, text: str, field: str, why_none: str | None
) -> np.ndarray:
    """The token ids of ``text`` (the tokenizer's, without its special tokens); a
    :class:`CompanionError` naming ``field`` without a tokenizer (``why_none``: why there is
    none), for text of no token or with words the tokenizer does not know (its unknown token:
    never served)."""
    if tokenizer is None:
        raise CompanionError(
            f"{field}: text was given, but this companion has no tokenizer "
            f"({why_none or 'its run has none'}); serve with --tokenizer=bytes or "
            f"--tokenizer=<tokenizer.json>, or send token ids"
        )
    ids = tokenizer.encode(text)
    if ids.size == 0:
        raise CompanionError(f"{field}: the text encodes to no tokens; send some text")
    unknown = tokenizer.unknown(text)
    if unknown:
        raise CompanionError(
            f"{field}: the tokenizer does not know {sorted(set(unknown))[:5]!r:.200}; use "
            f"words of its vocabulary"
        )
    return ids
