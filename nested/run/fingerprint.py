"""The fingerprint of a model: what a saved state must match to be loaded into it.

A memory session (the carried fast state), an exported model or a companion agent's state was
learned by one model: one architecture (the config's ``model`` and ``levels`` sections and the
task's vocabulary) with one set of slow weights (a checkpoint step). Loading it into another
model would run without an error and compute nonsense, so every such file stores the
fingerprint of the model that wrote it and :func:`check` refuses a mismatch:

    {"architecture": "<16 hex digits>", "step": <int or None>}

``architecture`` is a hash of the canonical JSON of those sections (key order and the other
sections, such as ``train``, do not count); ``step`` is the slow weights' checkpoint step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ml_collections import config_dict

ARCHITECTURE = ("model", "levels")


def architecture(config: config_dict.ConfigDict | Mapping[str, Any]) -> str:
    """The hash of what fixes a model's shapes and computation: ``model``, ``levels`` and the
    task's ``vocab_size``."""
    plain = json.loads(config.to_json_best_effort()) if hasattr(config, "to_json") else config
    parts = {name: plain.get(name) for name in ARCHITECTURE}
    parts["vocab_size"] = (plain.get("task") or {}).get("vocab_size")
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def of(config: config_dict.ConfigDict | Mapping[str, Any], step: int | None) -> dict[str, Any]:
    """The fingerprint of the model ``config`` builds, with slow weights of ``step``."""
    return {"architecture": architecture(config), "step": None if step is None else int(step)}


def check(saved: Mapping[str, Any] | None, expected: Mapping[str, Any], what: str) -> list[str]:
    """Raise ``ValueError`` naming ``what`` when ``saved`` (a stored fingerprint, or None for a
    file written without one) is not of the model ``expected`` describes; returns the warnings
    for a state of the same architecture whose slow weights are of another step."""
    if saved is None:
        raise ValueError(
            f"{what} carries no model fingerprint (written by an older version or another "
            f"tool); it cannot be checked against this model: save it again from its model"
        )
    if saved.get("architecture") != expected["architecture"]:
        raise ValueError(
            f"{what} was written by another model (architecture {saved.get('architecture')}, "
            f"this one {expected['architecture']}: its model or levels sections or vocabulary "
            f"differ); load it into the model that wrote it"
        )
    if saved.get("step") != expected["step"]:
        return [
            f"{what} was written with the slow weights of step {saved.get('step')}, these are "
            f"of step {expected['step']}"
        ]
    return []
