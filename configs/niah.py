"""python experiments/train.py --config configs/niah.py --workdir runs/niah

Single needle in a haystack (``nested.data.NIAHTask``): a key-value needle hidden in noise,
asked for at the end; accuracy on the answer tokens per context length. Trained on 64-token
haystacks, evaluated at 64, 256 and 1024 tokens (``len64``, ``len256``, ``len1024``: up to 16x
the trained length). Trained at 256 tokens the task gives two scored tokens per 256 and a
DeltaNet stays at chance after 2000 steps (the needle is rarely retrieved early on, so
there is no signal to learn the write gates from); at 64 tokens it finds the retrieval and
carries it to longer haystacks (DeltaNet, 2000 steps, 2 min on 2 CPU cores: 100% / 93.4% /
55.5% at 64 / 256 / 1024 tokens).

Variants: ``configs/niah.py:<rule>`` for any rule of ``nested.recipes.RULES`` (default
``delta``). Vocabulary 512 instead of 8192 to fit a CPU budget
(``--config.task.vocab_size=8192`` for the full task).
"""

from ml_collections import config_dict

from nested.run import config as nc


def get_config(arg=None):
    rule = nc.variant(arg)
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config("niah", vocab_size=512, seq_len=64, eval_lengths=(64, 256, 1024))
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
        batch_size=32,
        log_every=50,
        eval_every=500,
        eval_batches=4,
        eval_batch_size=32,
        checkpoint_every=500,
    )
    config.plasticity = nc.plasticity_config()  # plasticity.every=N: alignment in training
    return config
