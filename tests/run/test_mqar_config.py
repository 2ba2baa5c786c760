"""``configs/mqar.py:zoology-<variant>``: Zoology's figure-2 shapes (vocabulary 8192, the three
(sequence, pairs) settings for training and test, two layers), read from the built experiment
and the model's shapes (nothing allocated)."""

import pytest
from flax import nnx
from helpers import tiny_configs

from nested import data
from nested.run import config as nc

PATH = tiny_configs.path("mqar")
ZOOLOGY = ((64, 4), (128, 8), (256, 16))


@pytest.mark.parametrize("variant", ["delta", "attention", "hope"])
def test_zoology_variant_has_the_papers_shapes(variant):
    cfg = nc.load(f"{PATH}:zoology-{variant}")
    experiment = nc.build(cfg)
    task = experiment.task
    assert (task.vocab_size, task.train_settings, task.test_settings) == (8192, ZOOLOGY, ZOOLOGY)
    assert task.eval_splits == ("seq64_kv4", "seq128_kv8", "seq256_kv16")
    assert task.random_non_queries is False
    model = nnx.eval_shape(lambda: experiment.system.outer.memory(nnx.Rngs(0)))
    assert len(model.blocks) == 2
    assert model.embed.embedding.shape == (8192, 64)
    assert data.as_arrays(task.batch(0, 2))["inputs"].shape == (2, 256)  # padded mixture
    assert (cfg.train.batch_size, cfg.train.steps) == (256, 25_000)
    assert cfg.train.eval_batches * cfg.train.eval_batch_size == 3000


def test_zoology_variant_keeps_the_base_config_apart():
    """The plain variant is unchanged: one layer, vocabulary 256; a typo names both forms."""
    base = nc.load(f"{PATH}:delta")
    assert (base.model.layers, base.task.vocab_size) == (1, 256)
    with pytest.raises(nc.ConfigError, match="'detla' is unknown.*each also as zoology-"):
        nc.load(f"{PATH}:zoology-detla")
