"""python experiments/train.py --config configs/continual.py --workdir runs/continual

A continual key-value stream (``nested.data.ContinualTask``): the key -> value mapping
shifts from task to task every ``switch_every`` batches, and each batch row has its own
mappings, so slow weights (shared by all rows) cannot memorise them: the model must read the
pairs presented in the sequence, or recall the row's mapping from its fast state. The memory
level keeps that state across sequences (``persist="stream"``; row r of one batch continues
row r of the next), so it can answer keys not presented in the sequence from what it stored
before. Eval splits ``task<k>`` report accuracy on every task over time (forgetting), split
into ``in_context_accuracy`` and ``memory_accuracy``.
``python experiments/eval.py --workdir runs/continual --save_memory runs/continual/memory``
then continues the memory in a later session (``--load_memory``).

Variants: ``configs/continual.py:<rule>`` for any rule of ``nested.recipes.RULES``; and three
models of equal slow-parameter count for the functional-plasticity comparison (RESULTS.md,
"Functional plasticity"; ``experiments/plasticity.py`` measures them), trained on agents:
every row gets a new agent every 32 batches (``task.agent_every``: its fast state restarts),
whose four tasks switch every 8 batches with half the keys remapped, so the slow weights learn
how to learn an agent rather than the agents' mappings:

* ``one_level``: the DeltaNet memory carried across sequences, then a SwiGLU MLP (width 2x);
* ``two_level``: a fast in-context DeltaNet memory that restarts at every sequence, then a
  slow persistent level: a CMS block (an MLP of width 192, the same parameter count as the
  SwiGLU MLP) learning from the loss every 16 tokens and carried across sequences;
* ``hope``: Hope: a self-modifying DeltaNet memory (its projections fast memories updated
  every 8 tokens, restarting at every sequence) and two persistent CMS blocks (width 96,
  periods 16 and 48, a sequence).

Multi-frequency memories at equal budgets (RESULTS.md, "Multi-frequency memory and
forgetting"; ``experiments/plasticity.py`` prints each model's slow parameters and carried
bytes), every memory carried across sequences:

* ``periods_1_C`` (C in 8, 32, 128): ``one_level`` whose second memory head is a slow level
  learning the same stream, its updates summed and applied every C tokens
  (``levels.slow.accumulate``; periods span sequences);
* ``consolidate_1_C``: the slow head learns the fast head's keys and its reads of them;
* ``one_level_wide``: one level at their bytes (values 48 wide, the MLP narrowed);
* ``three_level``: three heads at periods 1, 16, 256, each slower one consolidating the one
  before; ``one_level_wider``: one level at its bytes and parameters;
* ``hope_carried``: ``hope`` with its memory and projections carried across sequences.
"""

from ml_collections import config_dict

from nested.run import config as nc

# The plasticity comparison (module docstring): every row a new agent every 32 batches, whose
# four tasks switch every 8 batches, half the keys remapped at each switch; 16 pairs in each
# sequence (with 8, a DeltaNet did not start recalling within 1200 steps), 3000 steps.
AGENTS = dict(agent_every=32, switch_every=8, remap_fraction=0.5, num_pairs=16)
TRAIN = dict(steps=3000)
SLOW_PERIODS = (8, 32, 128)  # tokens; a sequence is 48, so the longer periods span sequences
THREE_MLP, WIDER_MLP = 128, 74  # the three-level pair, matched at 93k parameters
VARIANTS = {
    "one_level": dict(
        task=AGENTS, train=TRAIN, model=dict(mlp_ratio=2), levels={"memory": dict(rule="delta")}
    ),
    "two_level": dict(
        task=AGENTS,
        train=TRAIN,
        model=dict(cms=("slow",)),
        levels={
            "memory": dict(rule="delta", persist="sequence"),
            "slow": dict(rule="cms", every=16, hidden=192),
        },
    ),
    **{
        f"{kind}_1_{period}": dict(
            task=AGENTS,
            train=TRAIN,
            model=dict(mlp_ratio=2, head_levels=("slow",), consolidate=kind == "consolidate"),
            levels={
                "memory": dict(rule="delta"),
                "slow": dict(rule="delta", accumulate=period, read="chunk_start"),
            },
        )
        for kind in ("periods", "consolidate")
        for period in SLOW_PERIODS
    },
    # Three levels, periods {1, 16, 256}: three heads of 32 x 32, each slower one
    # consolidating the one before it; and one level at its bytes (values 80 wide)
    "three_level": dict(
        task=AGENTS,
        train=TRAIN,
        model=dict(heads=3, mlp_hidden=THREE_MLP, head_levels=("mid", "slow"), consolidate=True),
        levels={
            "memory": dict(rule="delta", d_k=32, d_v=32),
            **{
                name: dict(rule="delta", d_k=32, d_v=32, accumulate=period, read="chunk_start")
                for name, period in (("mid", 16), ("slow", 256))
            },
        },
    ),
    "one_level_wider": dict(
        task=AGENTS,
        train=TRAIN,
        model=dict(mlp_hidden=WIDER_MLP),
        levels={"memory": dict(rule="delta", d_k=32, d_v=80)},
    ),
    # One level at the bytes of the two-level models (their slow head carries its pending
    # sum too): values 48 wide instead of 32, the MLP narrowed to keep the parameter count.
    "one_level_wide": dict(
        task=AGENTS,
        train=TRAIN,
        model=dict(mlp_hidden=90),
        levels={"memory": dict(rule="delta", d_k=32, d_v=48)},
    ),
    # Hope as in RESULTS.md (memory and projections restart at every sequence), and with
    # them carried across sequences as one_level's memory is
    **{
        name: dict(
            task=AGENTS,
            train=TRAIN,
            model=dict(mixer="self_modifying", projections="projections", cms=("cms1", "cms2")),
            levels={
                "memory": dict(rule="delta", owner="projections", persist=persist),
                "projections": dict(rule="projections", every=8, persist=persist),
                "cms1": dict(rule="cms", every=16, hidden=96),
                "cms2": dict(rule="cms", every=48, hidden=96),
            },
        )
        for name, persist in (("hope", "sequence"), ("hope_carried", "stream"))
    },
}


def get_config(arg=None):
    rule = nc.variant(arg, others=VARIANTS)
    spec = VARIANTS.get(rule, dict(levels={"memory": dict(rule=rule)}))
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config(
        "continual",
        vocab_size=256,
        num_keys=32,
        num_queries=8,
        num_tasks=4,
        **{"num_pairs": 8, "switch_every": 300, **spec.get("task", {})},
    )
    config.model = nc.model_config(
        "memory_lm",
        level="memory",  # the mixer's fast level: levels.memory
        dim=64,
        layers=1,
        **{"heads": 2, "mlp_ratio": 0, **spec.get("model", {})},
    )
    config.levels = config_dict.ConfigDict(
        {
            name: nc.level_config(**{"persist": "stream", **fields})
            for name, fields in spec["levels"].items()
        }
    )
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=3e-3, weight_decay=0.1, b2=0.98, warmup_steps=50
    )
    config.train = nc.train_config(
        **{
            "steps": 1200,
            "batch_size": 32,
            "log_every": 25,
            "eval_every": 75,
            "eval_batches": 2,
            "eval_batch_size": 32,
            "checkpoint_every": 75,
            **spec.get("train", {}),
        }
    )
    config.plasticity = nc.plasticity_config()  # plasticity.every=N: alignment in training
    return config
