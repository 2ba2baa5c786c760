"""python experiments/train.py --config configs/mqar.py --workdir runs/mqar

Multi-query associative recall (Zoology; ``nested.data.MQARTask``), the default experiment:
a one-layer language model whose token mixer is a fast-weight memory (DeltaNet by default)
learns in-context key -> value recall, tested on the three trained settings and on twice the
length and pairs (128 tokens, 32 pairs). Its accuracy and wall time: RESULTS.md (MQAR table).

Variants: ``configs/mqar.py:<rule>`` for any rule of ``nested.recipes.RULES`` (default
``delta``), e.g. ``--config configs/mqar.py:gated_delta``; and ``configs/mqar.py:hope``, a
small Hope model: a self-modifying DeltaNet memory (``levels.memory``, owned by its key, value
and query projections, ``levels.projections``, fast memories updated every 8 tokens) and a
Continuum Memory System of two MLP blocks learning over windows of 16 and 64 tokens
(``levels.cms1``, ``levels.cms2``; its accuracy: RESULTS.md, rows ``hope``). Overrides:
``--config.model.dim=128``, ``--config.levels.memory.every=16`` (mini-batch TTT),
``--config.train.steps=2000``.

Differences from Zoology, for a CPU budget of minutes: vocabulary 256 instead of 8192 (at
8192 the embeddings and the output layer take most of a step's time on a CPU, and 4096 key
embeddings need many more steps to learn), and sequences of 64 tokens with 4-16 pairs instead
of the 64-256 token curriculum.
``--config.task.vocab_size=8192`` and
``--config.task.train_settings="((64,4),(128,8),(256,16),(256,32),(256,64))"`` restore
Zoology's settings (for an accelerator).
"""

from ml_collections import config_dict

from nested.run import config as nc

TRAIN = ((64, 4), (64, 8), (64, 16))
TEST = (*TRAIN, (128, 32))  # the last one: twice the trained length and pairs

# Variants that are not one memory rule: the model's mixer settings and its levels (CMS
# periods divide every sequence length, 64 and 128).
VARIANTS = {
    "hope": dict(
        model=dict(mixer="self_modifying", projections="projections", cms=("cms1", "cms2")),
        levels={
            "memory": dict(rule="delta", owner="projections"),
            "projections": dict(rule="projections", every=8),
            "cms1": dict(rule="cms", every=16),
            "cms2": dict(rule="cms", every=64),
        },
    ),
}


def get_config(arg=None):
    rule = nc.variant(arg, others=VARIANTS)
    spec = VARIANTS.get(rule, dict(levels={"memory": dict(rule=rule)}))
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config("mqar", vocab_size=256, train_settings=TRAIN, test_settings=TEST)
    config.model = nc.model_config(
        "memory_lm",
        level="memory",  # the mixer's fast level: levels.memory
        dim=64,
        heads=2,
        layers=1,
        mlp_ratio=0,
        **spec.get("model", {}),
    )
    config.levels = config_dict.ConfigDict(
        {name: nc.level_config(**fields) for name, fields in spec["levels"].items()}
    )
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=3e-3, weight_decay=0.1, b2=0.98, warmup_steps=50
    )
    config.train = nc.train_config(
        steps=700,
        batch_size=32,
        log_every=20,
        eval_every=100,
        eval_batches=4,
        eval_batch_size=128,
        checkpoint_every=100,
    )
    config.plasticity = nc.plasticity_config()  # plasticity.every=N: alignment in training
    return config
