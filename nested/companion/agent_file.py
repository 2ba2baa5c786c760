"""The portable file of one agent's state (export and import): flax msgpack of a mapping
``{"fingerprint": str, "tokens": int, "state": the fast state's state dict}``.

:func:`read` checks everything the file carries before anything is written: its structure,
the fingerprint a string, a token count that is an ``int`` in ``[0, 2**63)`` (SQLite's range);
:func:`check_state` then holds the state to the model's: every array's shape and dtype, finite
values. Anything else is a :class:`CompanionError` (422) naming what is wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import serialization

from nested.companion.inputs import MAX_STORED_TOKENS, CompanionError, finite

FIELDS = ("fingerprint", "tokens", "state")


def write(fingerprint: str, tokens: int, state: dict) -> bytes:
    """The file of a state dict written by the model of ``fingerprint`` after ``tokens``."""
    return serialization.msgpack_serialize(
        {"fingerprint": fingerprint, "tokens": tokens, "state": state}
    )


def read(data: bytes) -> tuple[str, int, Any]:
    """``(fingerprint, tokens, state)`` of a file :func:`write` wrote; the state unchecked
    (:func:`check_state`)."""
    try:
        content = serialization.msgpack_restore(data)
    except Exception as error:  # noqa: BLE001 - any malformed file is the caller's
        raise CompanionError(f"import: not a companion state file ({error!r:.200})") from error
    if not isinstance(content, dict) or set(FIELDS) - set(content):
        raise CompanionError(
            "import: not a companion state file (expected a mapping with 'fingerprint', "
            "'tokens' and 'state', as export writes)"
        )
    fingerprint, tokens = content["fingerprint"], content["tokens"]
    if not isinstance(fingerprint, str):
        raise CompanionError(
            f"import: fingerprint: expected a string, got {_describe(fingerprint)}"
        )
    if type(tokens) is not int or not 0 <= tokens <= MAX_STORED_TOKENS:
        raise CompanionError(
            f"import: tokens: expected an integer in [0, {MAX_STORED_TOKENS}], got "
            f"{_describe(tokens)}"
        )
    return fingerprint, tokens, content["state"]


def check_state(value, template, where: str = "state") -> None:
    """Raise :class:`CompanionError` naming ``where`` unless ``value`` (a restored state dict)
    has the structure, shapes and dtypes of ``template`` (the model's) and finite values."""
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise CompanionError(f"import: {where}: expected a mapping, got {_describe(value)}")
        missing, extra = sorted(set(template) - set(value)), sorted(set(value) - set(template))
        if missing or extra:
            raise CompanionError(
                f"import: {where}: the keys differ from this model's state (missing "
                f"{missing[:5]!r:.100}, unexpected {extra[:5]!r:.100})"
            )
        for key in template:
            check_state(value[key], template[key], f"{where}.{key}")
    elif template is None:
        if value is not None:
            raise CompanionError(f"import: {where}: expected nothing, got {_describe(value)}")
    elif (
        not isinstance(value, np.ndarray)
        or value.shape != template.shape
        or value.dtype != template.dtype
    ):
        raise CompanionError(
            f"import: {where}: expected a {template.dtype} array of shape {template.shape}, "
            f"got {_describe(value)}"
        )
    elif not finite(value):
        raise CompanionError(f"import: {where}: has values that are not finite (NaN or inf)")


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    return f"{type(value).__name__} {value!r:.40}"
