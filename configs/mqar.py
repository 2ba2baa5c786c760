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

Zoology's figure 2 (Arora et al. 2023, arXiv:2312.04927): ``configs/mqar.py:zoology-<rule>``
(``<rule>`` any variant above, or ``attention``: MemoryLM's softmax attention, one head), e.g.
``configs/mqar.py:zoology-delta``: vocabulary 8192, trained and tested on (sequence, pairs)
(64, 4), (128, 8) and (256, 16), two layers, no MLP (Zoology's ``state_mixer`` is the
identity), width ``--config.model.dim`` (64, 128, 256 in the paper) and learning rate
``--config.optimizer.learning_rate`` (the paper sweeps ``np.logspace(-4, -2, 4)``, 1e-4 to
1e-2, and plots the best). Kept from Zoology's figure-2 sweep (HazyResearch/zoology,
``zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py``): the settings, the
vocabulary, two layers, no filler tokens between queries (``random_non_queries=False``), query
gaps of ``power_a=0.01``, AdamW (weight decay 0.1, beta2 0.999) with a cosine to 0, 3,000 test
sequences a setting, one attention head and two for the memories (as Zoology's later DeltaNet
configs), 64 epochs of 100,000 training sequences (25,000 steps at batch 256; Zoology uses 512
at 64 and 128 tokens). Changed: one model learns the three settings (a uniform mixture, every
row padded to 256 tokens) where Zoology trains one per setting; fresh sequences every step
instead of a fixed training set, and no early stop at 99%; RoPE in the attention instead of
learned positions, RMSNorm instead of LayerNorm, no dropout, an output head not tied to the
embedding (Zoology ties them), the memories' short convolution (``model.conv=4``), a warmup of
100 steps. RESULTS.md, "MQAR at Zoology's settings", runs them on a CPU budget (its overrides
line says what it cuts).
"""

from ml_collections import config_dict

from nested.run import config as nc

TRAIN = ((64, 4), (64, 8), (64, 16))
TEST = (*TRAIN, (128, 32))  # the last one: twice the trained length and pairs
ZOOLOGY = ((64, 4), (128, 8), (256, 16))  # Zoology's figure 2: (sequence, pairs), train and test
ZOOLOGY_PREFIX = "zoology-"

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
    # MemoryLM's Transformer++ mixer: causal RoPE softmax attention over the whole sequence,
    # one head (as Zoology's attention), no fast level
    "attention": dict(model=dict(mixer="attention", level=None, window=None, heads=1), levels={}),
}
# The Zoology variants' sections (the module docstring); the model: two layers
ZOOLOGY_CONFIG = dict(
    task=dict(
        vocab_size=8192,
        train_settings=ZOOLOGY,
        test_settings=ZOOLOGY,
        random_non_queries=False,
    ),
    optimizer=dict(b2=0.999, min_lr_ratio=0.0, warmup_steps=100),
    train=dict(steps=25_000, batch_size=256, eval_every=1000, eval_batches=12, eval_batch_size=250),
)


def get_config(arg=None):
    zoology = (arg or "").startswith(ZOOLOGY_PREFIX)
    try:
        rule = nc.variant(arg.removeprefix(ZOOLOGY_PREFIX) if zoology else arg, others=VARIANTS)
    except nc.ConfigError as error:
        raise nc.ConfigError(f"{error}, each also as {ZOOLOGY_PREFIX}<variant>") from None
    spec = VARIANTS.get(rule, dict(levels={"memory": dict(rule=rule)}))
    paper = ZOOLOGY_CONFIG if zoology else {}
    config = config_dict.ConfigDict()
    config.seed = 0
    task = dict(vocab_size=256, train_settings=TRAIN, test_settings=TEST)
    config.task = nc.task_config("mqar", **{**task, **paper.get("task", {})})
    # level: the mixer's fast level, levels.memory
    model = dict(level="memory", dim=64, heads=2, layers=2 if zoology else 1, mlp_ratio=0)
    config.model = nc.model_config("memory_lm", **{**model, **spec.get("model", {})})
    config.levels = config_dict.ConfigDict(
        {name: nc.level_config(**fields) for name, fields in spec["levels"].items()}
    )
    optimizer = dict(learning_rate=3e-3, weight_decay=0.1, b2=0.98, warmup_steps=50)
    config.optimizer = nc.optimizer_config("adamw", **{**optimizer, **paper.get("optimizer", {})})
    train = dict(
        steps=700,
        batch_size=32,
        log_every=20,
        eval_every=100,
        eval_batches=4,
        eval_batch_size=128,
        checkpoint_every=100,
    )
    config.train = nc.train_config(**{**train, **paper.get("train", {})})
    config.plasticity = nc.plasticity_config()  # plasticity.every=N: alignment in training
    return config
