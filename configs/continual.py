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

Variants: ``configs/continual.py:<rule>`` for any rule of ``nested.recipes.RULES``.
"""

from ml_collections import config_dict

from nested.run import config as nc


def get_config(arg=None):
    rule = nc.variant(arg)
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config(
        "continual",
        vocab_size=256,
        num_keys=32,
        num_pairs=8,
        num_queries=8,
        num_tasks=4,
        switch_every=300,
    )
    config.model = nc.model_config(
        "memory_lm",
        level="memory",  # the mixer's fast level: levels.memory
        dim=64,
        heads=2,
        layers=1,
        mlp_ratio=0,
    )
    config.levels = config_dict.ConfigDict({"memory": nc.level_config(rule, persist="stream")})
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=3e-3, weight_decay=0.1, b2=0.98, warmup_steps=50
    )
    config.train = nc.train_config(
        steps=1200,
        batch_size=32,
        log_every=25,
        eval_every=75,
        eval_batches=2,
        eval_batch_size=32,
        checkpoint_every=75,
    )
    return config
