"""Padded vocabularies (``model.vocab_multiple``): the embedding and the head padded, the padded
logits masked, so nothing that reads the logits (loss, eval, sampling, export) sees them.

One tiny char-LM (vocabulary 256) twice, built from its config: unpadded, and padded to 288
(``vocab_multiple=96``) with the unpadded weights on its real rows and large random head
columns on its padded ones (unmasked, they would take almost all the probability). The mesh
runs, 8 simulated devices with the bytes vocabulary, are in ``tests/run/test_sharding.py``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_configs

import nested as nl
from nested.nn.models import padded_vocab
from nested.run import config as nc
from nested.run import export, partitioning, perplexity
from nested.run.loading import Trained

TINY = {
    "task.seq_len": 16,
    "model.dim": 16,
    "model.heads": 2,
    "model.layers": 1,
    "train.batch_size": 2,
    "train.eval_batch_size": 2,
}
V, PADDED, MULTIPLE = 256, 288, 96
TOKENS = np.random.default_rng(0).integers(0, V, (3, 17)).astype(np.int32)
BATCH = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:], "mask": np.ones((3, 16), np.float32)}


def char_lm(corpus, **more):
    config = nc.load(tiny_configs.path("char_lm"))
    return tiny_configs.override(config, {**TINY, "task.path": str(corpus), **more})


def pad_like(padded, plain, fill):
    """``padded``'s arrays of ``fill(shape)``, holding ``plain``'s arrays in their leading
    rows and columns (all of them where the shapes agree)."""
    grow = lambda p, q: fill(p.shape).astype(p.dtype).at[tuple(slice(0, n) for n in q.shape)].set(q)
    return jax.tree.map(grow, padded, plain)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "text.txt"
    corpus.write_text("the padded columns never get probability\n" * 20)
    plain = nc.build(char_lm(corpus))
    padded = nc.build(char_lm(corpus, **{"model.vocab_multiple": MULTIPLE}))
    plain_state = jax.jit(plain.program.init)(jax.random.key(0))
    padded_state = jax.jit(padded.program.init)(jax.random.key(0))
    big = lambda shape: 30.0 * jax.random.normal(jax.random.key(1), shape)
    params = pad_like(padded_state.params, plain_state.params, big)
    return {
        "plain": Trained(plain, plain_state, 0),
        "padded": Trained(padded, padded_state.replace(params=params), 0),
        "corpus": corpus,
    }


def test_vocab_multiple_pads_the_embedding_and_head_and_1_keeps_todays_shapes(models):
    plain, padded = models["plain"], models["padded"]
    assert plain.config.model.vocab_multiple == 1
    params = lambda trained: nnx.to_pure_dict(trained.state.params)
    ours, theirs = params(plain), params(padded)
    assert ours["embed"]["embedding"].shape == (V, 16) and ours["head"]["kernel"].shape == (16, V)
    assert theirs["embed"]["embedding"].shape == (PADDED, 16)
    assert theirs["head"]["kernel"].shape == (16, PADDED)
    assert plain.program.vocab == padded.program.vocab == V
    # a multiple that divides the vocabulary pads nothing: the same parameters, seed for seed
    same = nc.build(char_lm(models["corpus"], **{"model.vocab_multiple": 128}))
    chex.assert_trees_all_equal(
        jax.jit(same.program.init)(jax.random.key(0)).params, plain.state.params
    )


def test_padded_logits_get_exactly_zero_probability_and_the_unpadded_loss(models):
    plain, padded = models["plain"], models["padded"]
    apply = lambda t: jax.jit(t.program.apply)(t.state.params, BATCH["inputs"])[0]
    logits, reference = apply(padded), apply(plain)
    assert logits.shape == (3, 16, PADDED)
    probs = jax.nn.softmax(logits, axis=-1)
    assert float(jnp.max(probs[..., V:])) == 0.0

    @jax.jit
    def unmasked(params, inputs):  # the model told that all 288 columns are its vocabulary
        model = padded.program.model(params)
        model.vocab = PADDED
        return model(inputs, model.initial_fast(inputs.shape[0]))[0]

    raw = unmasked(padded.state.params, BATCH["inputs"])
    assert float(jnp.min(jnp.sum(jax.nn.softmax(raw, -1)[..., V:], -1))) > 0.99
    np.testing.assert_allclose(
        jax.nn.log_softmax(logits)[..., :V], jax.nn.log_softmax(reference), atol=1e-6
    )
    loss = lambda t: jax.jit(jax.value_and_grad(lambda p: t.program.loss(p, BATCH)[0]))(
        t.state.params
    )
    (ours, grads), (theirs, plain_grads) = loss(padded), loss(plain)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    head = grads["head"]["kernel"][...]
    assert float(jnp.max(jnp.abs(head[:, V:]))) == 0.0  # the padding never learns
    np.testing.assert_allclose(head[:, :V], plain_grads["head"]["kernel"][...], atol=1e-6)
    chex.assert_trees_all_close(grads["blocks"], plain_grads["blocks"], atol=1e-6)


def test_sampling_never_draws_a_padded_id_and_draws_what_the_unpadded_model_draws(models):
    plain, padded = models["plain"], models["padded"]
    prompt = TOKENS[:, :4]
    for options in (dict(temperature=2.0, top_k=V), {}):
        draw = lambda t, options=options: nl.generate(
            t.program, t.state.params, prompt, max_new_tokens=24, rng=5, **options
        )
        ours, theirs = draw(padded), draw(plain)
        assert int(jnp.max(ours.tokens)) < V
        np.testing.assert_array_equal(ours.tokens, theirs.tokens, err_msg=str(options))


def test_eval_scores_and_export_are_those_of_the_unpadded_model(models, tmp_path):
    plain, padded = models["plain"], models["padded"]
    score = lambda t: perplexity.make_score_fn(t.program)(
        t.state.params, BATCH["inputs"], BATCH["targets"], BATCH["mask"], None
    )[0]
    np.testing.assert_allclose(score(padded), score(plain), rtol=1e-6, atol=1e-6)
    path = nl.export_model(tmp_path / "padded.msgpack", padded)
    back = nl.import_model(path)
    assert back.program.vocab == V
    chex.assert_trees_all_equal(back.state.params, padded.state.params)
    with pytest.raises(export.ExportError, match="written by another model"):
        nl.import_model(path, plain.config)


def test_a_mesh_that_does_not_divide_the_vocabulary_names_vocab_multiple(models):
    """257 bytes on tensor=2: the error names the fix; padded to 384, tensor=8 splits it."""
    specs = lambda vocab, multiple, tensor: partitioning.parameter_specs(
        {"embed": {"embedding": jax.ShapeDtypeStruct((padded_vocab(vocab, multiple), 16), "f4")}},
        partitioning.RULE_DEFAULTS,
        {"data": 1, "fsdp": 1, "tensor": tensor},
    )["embed"]["embedding"]
    with pytest.raises(ValueError, match="dim 0 \\(vocab\\) of size 257") as info:
        specs(257, 1, 2)
    assert str(info.value).endswith(
        "or pad the vocabulary to a multiple of 2: model.vocab_multiple=128"
    )
    assert specs(257, 128, 8) == jax.sharding.PartitionSpec("tensor")
    with pytest.raises(nc.ConfigError, match="model: vocab_multiple=0 must be an int >= 1"):
        nc.build(char_lm(models["corpus"], **{"model.vocab_multiple": 0}))
