"""python experiments/train.py --config configs/companion.py --workdir runs/companion

The Agent Companion task (``nested.data.CompanionTask``): every batch row is an agent with a
private rule (each of 32 feature tokens votes for one of 8 labels; an input is 3 features),
observed as (input, answer) events, 16 a sequence, over 8 sessions of 2 sequences: four
sessions to learn, the rule drifting at the fifth, four to recover; two rule-breaking facts
shown at its start; every 16 batches each row gets a new agent and its fast state restarts.
The memory (DeltaNet) keeps its state across an agent's sequences (``persist="stream"``), so
the slow weights learn how a fast state learns an agent: they never see the agents a
deployment serves. ``python experiments/serve.py --workdir
runs/companion`` serves the trained model, one learning memory per agent; RESULTS.md ("Agent
companion") compares it with retrieval memories on held-out agents.

Variants: ``configs/companion.py:<rule>`` for any rule of ``nested.recipes.RULES``;
``configs/companion.py:text``: the same agents, each event a sentence ("the heavy round
wooden box is red .", ``task.text=True``), in the task's own word-level tokens
(``--config.task.tokenizer=<tokenizer.json>``: a corpus tokenizer giving each word one token);
``serve.py`` then takes and answers text.
``configs/companion.py:aligned``: keys aligned with their queries: the write at an answer
token uses the key of the token before it (``model.key_shift``), the input's last feature,
whose short convolution (``model.conv``, as wide as an input) spans the input's features and
nothing else: the answer is written under a key made of the features its query reads.
``configs/companion.py:mixture``: aligned, on agents of several families (``task.families``:
2, 3 or 4 features per input, pair rules; ``one_feature`` held out of training, the study's
generalisation row), events padded to 4 feature slots.
"""

from ml_collections import config_dict

from nested.run import config as nc

MIXTURE = ("k2", "k3", "k4", "pairs")  # the mixture's training families; one_feature held out


def get_config(arg=None):
    text, mixture = arg == "text", arg == "mixture"
    aligned = mixture or arg == "aligned"
    rule = nc.variant(None if text or aligned else arg, others=("text", "aligned", "mixture"))
    config = config_dict.ConfigDict()
    config.seed = 0
    families = {"families": MIXTURE, "input_width": 4} if mixture else {}
    config.task = nc.task_config("companion", text=text, **families)
    width = 4 if mixture else config.task.features_per_input
    config.model = nc.model_config(
        "memory_lm",
        level="memory",  # the mixer's fast level: levels.memory
        dim=64,
        heads=2,
        layers=1,
        mlp_ratio=2,
        **({"key_shift": True, "conv": width} if aligned else {}),
    )
    config.levels = config_dict.ConfigDict({"memory": nc.level_config(rule, persist="stream")})
    config.optimizer = nc.optimizer_config(
        "adamw", learning_rate=3e-3, weight_decay=0.1, b2=0.98, warmup_steps=100
    )
    config.train = nc.train_config(
        steps=6000,
        batch_size=32,
        log_every=50,
        eval_every=250,
        eval_batches=2,
        eval_batch_size=32,
        checkpoint_every=250,
    )
    config.plasticity = nc.plasticity_config()  # plasticity.every=N: alignment in training
    return config
