"""A model's fingerprint: its architecture hash ignores everything but model, levels and the
vocabulary; check refuses another architecture and warns about other slow weights."""

import pytest
from helpers import tiny_configs

from nested.run import fingerprint


def test_the_architecture_is_model_levels_and_vocabulary():
    delta = tiny_configs.config("continual")
    same = tiny_configs.config("continual", train__steps=99, seed=7)
    assert fingerprint.architecture(delta) == fingerprint.architecture(same)
    other_rule = tiny_configs.config("continual", levels__memory__rule="gated_delta")
    other_vocab = tiny_configs.config("continual", task__vocab_size=64)
    for other in (other_rule, other_vocab):
        assert fingerprint.architecture(other) != fingerprint.architecture(delta)


def test_check_refuses_another_architecture_and_warns_about_another_step():
    config = tiny_configs.config("continual")
    here = fingerprint.of(config, 8)
    assert fingerprint.check(here, here, "session s") == []
    warnings = fingerprint.check(fingerprint.of(config, 4), here, "session s")
    assert warnings == [
        "session s was written with the slow weights of step 4, these are of step 8"
    ]
    other = fingerprint.of(tiny_configs.config("continual", levels__memory__rule="gated_delta"), 8)
    with pytest.raises(ValueError, match="session s was written by another model"):
        fingerprint.check(other, here, "session s")
    with pytest.raises(ValueError, match="session s carries no model fingerprint"):
        fingerprint.check(None, here, "session s")
