"""python experiments/train.py --config configs/niah.py --workdir runs/niah

Single needle in a haystack (``nested.data.NIAHTask``): a key-value needle hidden in noise,
asked for at the end; accuracy on the answer tokens per context length (eval splits
``len256``, ``len512``, ``len1024``: up to 4x the trained length).

Variants: ``configs/niah.py:<rule>`` for any rule of ``nested.recipes.RULES`` (default
``delta``). Vocabulary 512 instead of 8192 to fit a CPU budget
(``--config.task.vocab_size=8192`` for the full task).
"""

from ml_collections import config_dict

from nested import config as nc


def get_config(arg=None):
    rule = nc.variant(arg)
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config("niah", vocab_size=512, seq_len=256, eval_lengths=(256, 512, 1024))
    config.model = nc.model_config(
        "memory_lm",
        level="memory",  # the mixer's fast level: levels.memory
        dim=64,
        heads=2,
        layers=2,
        mlp_ratio=0,
    )
    config.levels = config_dict.ConfigDict({"memory": nc.level_config(rule)})
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=3e-3, weight_decay=0.1, b2=0.98, warmup_steps=100
    )
    config.train = nc.train_config(
        steps=2000,
        batch_size=16,
        log_every=50,
        eval_every=500,
        eval_batches=4,
        eval_batch_size=32,
        checkpoint_every=500,
    )
    return config
