"""python experiments/train.py --config configs/char_lm.py --workdir runs/char_lm

Byte-level language modelling on real text (``nested.data.CharLMTask``): by default the
Python standard library's own sources, held-out files scored in bits per character.
``--config.task.path=/some/text/or/folder`` trains on other text.

Variants: ``configs/char_lm.py:<variant>`` with a variant of ``VARIANTS`` (default
``delta``); a variant is the model's mixer settings and its levels:

* ``delta``, ``ttt_linear``, ``ttt_mlp``, ``titans``: the mixer is the memory level alone;
* ``titans_mag``: Titans memory-as-gate, the memory gating sliding-window attention (32);
* ``titans_mac``: Titans memory-as-context: segments of 32 tokens attend over 4 persistent
  tokens, their retrieval from the memory and themselves, then write the memory (in
  mini-batches of 16); ``--config.model.persistent=8`` sets the persistent tokens;
* ``hope``: Hope (Nested Learning): a self-modifying Titans memory (mini-batches of 16 tokens)
  whose key, value and query projections are fast memories (``levels.projections``, updated
  every 16 tokens on self-generated targets, owning ``levels.memory``), and a Continuum Memory
  System of three MLP blocks in place of the MLP, learning from the loss over windows of 16,
  64 and 128 tokens (``levels.cms1..cms3``).

The ``titans`` variant updates its memory at every token (``every=1``, step range (0, 0.1)).
In chunks, ``--config.levels.memory.every=16``, the chunk's steps are all taken at the
chunk-start state and add up, so the recipe's step range shrinks to (0, 0.1 / 16) (with 0.1
the memory diverges at the first step); chunked, it trains faster and ends lower than per-token
updates (RESULTS.md: rows ``titans`` and ``titans_every16``). Hope uses those chunks: with
per-token Titans inside, it trained slower, its outer gradient norm spiked early on, and it
ended with more bits per character.

Overrides as usual: ``--config.levels.memory.every=16``, ``--config.model.dim=256``,
``--config.levels.cms2.every=32``; ``--config.levels.cms1.first_order=True`` (and cms2, cms3)
makes the outer level take a CMS level's window gradients as constants (first-order
meta-learning: cheaper steps; RESULTS.md: rows ``hope`` and ``hope_first_order``).
"""

from ml_collections import config_dict

from nested.run import config as nc

SEQ_LEN = 128
CMS_PERIODS = (16, 64, 128)  # Hope's CMS levels, fastest first; each divides the next

VARIANTS = {
    "delta": dict(levels={"memory": dict(rule="delta")}),  # DeltaNet, online
    "ttt_linear": dict(levels={"memory": dict(rule="ttt_linear")}),  # mini-batches of 16
    "ttt_mlp": dict(levels={"memory": dict(rule="ttt_mlp")}),
    "titans": dict(levels={"memory": dict(rule="titans")}),
    "titans_mag": dict(model=dict(mixer="gate", window=32), levels={"memory": dict(rule="titans")}),
    "titans_mac": dict(
        model=dict(mixer="context", window=32), levels={"memory": dict(rule="titans", every=16)}
    ),
    "hope": dict(
        model=dict(
            mixer="self_modifying",
            projections="projections",
            cms=tuple(f"cms{i}" for i in range(1, len(CMS_PERIODS) + 1)),
        ),
        levels={
            "memory": dict(rule="titans", owner="projections", every=16),
            "projections": dict(rule="projections", every=16),
            **{
                f"cms{i}": dict(rule="cms", every=every, lr=0.01)
                for i, every in enumerate(CMS_PERIODS, start=1)
            },
        },
    ),
}


def get_config(arg=None):
    variant = arg or "delta"
    if variant not in VARIANTS:
        raise nc.ConfigError(f"configs/char_lm.py:{variant}: allowed variants {sorted(VARIANTS)}")
    spec = VARIANTS[variant]
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config("char_lm", seq_len=SEQ_LEN)
    config.model = nc.model_config(
        "memory_lm", level="memory", dim=128, heads=4, layers=2, **spec.get("model", {})
    )
    config.levels = config_dict.ConfigDict(
        {name: nc.level_config(**fields) for name, fields in spec["levels"].items()}
    )
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=2e-3, weight_decay=0.1, b2=0.98, warmup_steps=100
    )
    config.train = nc.train_config(
        steps=3000,
        batch_size=16,
        log_every=50,
        eval_every=500,
        eval_batches=8,
        eval_batch_size=16,
        checkpoint_every=500,
    )
    config.plasticity = nc.plasticity_config()  # plasticity.every=N: alignment in training
    return config
