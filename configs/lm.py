"""python experiments/train.py --config configs/lm.py:hope-340m --config.task.path=DIR --workdir W

Paper-size language models on a prepared token corpus (task ``tokens``: the folder
``experiments/prepare.py`` wrote; ``--config.task.path`` is required, the run stops with a
one-line error at once without it). The variant is ``<model>-<size>`` with a model
of :data:`MODELS` and a size of :data:`SIZES` (``125m``, ``340m``, ``760m``, ``1.3b``, and
``tiny``: a few hundred thousand parameters on a byte vocabulary, for tests; ``small``: 4 x 256
on a BPE of 8192, for studies on one CPU machine, :data:`CPU`). Paper sizes use a
32000-token vocabulary (the Llama-2 / Mistral tokenizers of the papers; the task checks that it
is not smaller than the corpus tokenizer's), bfloat16 compute (``train.dtype``; parameters and
fast states stay float32) and a batch of 0.5M tokens (2^19: 256 x 2048 or 128 x 4096).

Models (each a ``memory_lm`` whose mixer is named; every block adds a SwiGLU MLP):

* ``transformer``: Transformer++ (Llama-style: RoPE attention over the whole context, SwiGLU,
  RMSNorm), the baseline of every paper below; no fast level (``model.mixer='attention'``);
* ``deltanet``: DeltaNet (rule ``delta``), head width 128, no output gate, as fla's
  ``delta_net_340M`` config; ``gated_deltanet``: Gated DeltaNet (``gated_delta``), head width
  128 (the paper's 256-wide heads and doubled values are not used: this layer's heads are
  dim/heads wide for keys and values alike);
* ``ttt_linear``, ``ttt_mlp``: TTT-Linear and TTT-MLP, mini-batches of 16 tokens;
* ``titans``: the Titans long-term memory alone (LMM); ``titans_mac``, ``titans_mag``,
  ``titans_mal``: memory as context (segments of 512 tokens, 4 persistent tokens), as a gate of
  sliding-window attention (window 512) and as a layer before it;
* ``atlas``: ATLAS (Omega rule over 4 items, degree-2 polynomial keys, Muon);
* ``hope``: Hope, a self-modifying Titans memory and a Continuum Memory System of three MLP
  blocks updated every 16, 64 and 256 tokens, each half the SwiGLU width (so the three hold
  the parameters of one SwiGLU MLP).

The neural memories (TTT, Titans, ATLAS, Hope) update in chunks of :data:`CHUNK` = 16 tokens:
TTT's mini-batch; Titans, ATLAS and Hope train chunk-wise, and the chunk is not reported, so
16 is chosen. Not reported either, and chosen: the Titans segment and window (512), persistent
tokens (4), the ATLAS window and degree (the ``atlas`` recipe's defaults), the Hope CMS periods,
and two guards of the Titans memory measured on text here (RESULTS.md, "Language modelling on
real text"): its inner step range is half the ``titans`` recipe's (``lr_scale = 0.05 / C``;
at 0.1 / C the ``small`` Titans diverged within 80 steps in two runs), and Hope's memory clips
each token's gradient to norm 1 (``clip=1.0``, as titans-pytorch's ``max_grad_norm`` bounds
the memory's per-sample gradients; without it the ``small`` Hope diverged at step 65).

Sources (the setup each model trains in):

* TTT: Sun et al., "Learning to (Learn at Test Time): RNNs with Expressive Hidden States",
  arXiv:2407.04620, and its JAX code: 125M 12 x 768 (12 heads, MLP 2048), 350M 24 x 1024 (16,
  2736), 760M 24 x 1536 (16, 4096), 1.3B 24 x 2048 (32, 5504); context 2048, 256 sequences a
  step, AdamW (weight decay 0.1), peak lr 3e-3 / 1.5e-3 / 1.25e-3 / 1e-3, warmup 10% of the
  steps, cosine to 1e-5, 4800 / 13500 / 29000 / 50000 steps (2.5B / 7B / 15B / 26B tokens).
  These widths are the backbone of every model here.
* DeltaNet: Yang, Wang, Zhang, Shen, Kim, "Parallelizing Linear Transformers with the Delta
  Rule over Sequence Length", arXiv:2406.06484: 340M on 15B tokens, 1.3B on 100B, 0.5M-token
  batches; context 2048, peak lr 3e-4, weight decay 0.01, warmup 0.5B tokens, cosine to 10%.
* Gated DeltaNet: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
  Rule", arXiv:2412.06464: 1.3B on 100B tokens, context 4096, 0.5M-token batches, peak lr 4e-4,
  weight decay 0.1, warmup 1B tokens, cosine to 10%. Transformer++ trains in this setup.
* Titans: Behrouz, Zhong, Mirrokni, "Titans: Learning to Memorize at Test Time",
  arXiv:2501.00663: 340M on 15B tokens, 760M on 30B, context 4096, 0.5M-token batches, lr 4e-4,
  weight decay 0.1, cosine; layers and heads are not reported (the TTT widths are used).
* ATLAS: Behrouz et al., "ATLAS: Learning to Optimally Memorize the Context at Test Time",
  arXiv:2505.23735, in the Titans setup.
* Hope: Behrouz, Razaviyayn, Zhong, Mirrokni, "Nested Learning: The Illusion of Deep Learning
  Architectures", NeurIPS 2025, Table 1: 340M on 15B tokens, 760M on 30B, 1.3B on 100B, in
  the Titans setup.
* Transformer++: Touvron et al., "LLaMA: Open and Efficient Foundation Language Models",
  arXiv:2302.13971 (RoPE, SwiGLU of width 8/3 dim rounded, RMSNorm).

Checked against released code: the TTT figures (its JAX code's model configs and launch
scripts) and the DeltaNet and Transformer++ widths (fla's ``flame`` configs); the other
training figures are the papers' text, not re-checked here.

Budgets no paper gives, and chosen: every model at 125m trains TTT's 2.5B tokens (Chinchilla's
20 tokens a parameter); DeltaNet at 760m 30B tokens (the Titans budget); Titans at 1.3B the
100B of ATLAS and Hope. Warmup is the setup's, at most 10% of the steps. AdamW's b2 is 0.95
(not reported by these papers; the usual LLM choice). Steps are tokens / 0.5M.

Parameters count the input embedding and the output head, untied as the model builds them
(TTT ties them, so its "125M" is 110M counted once), and the learned initial states of the
fast memories. Where a mixer's extra projections push a model more than 10% past its size, it
is matched to the Transformer++ count of that size (:data:`ADJUSTED`): the SwiGLU width is cut
(``mlp``), except in the hybrids MAC, MAG and MAL, whose mixers hold attention and a memory
layer (their MLP would shrink below the model width): they keep two thirds of the layers, MAC
with a narrower MLP as well. The counts (``python -m pytest -s tests/run/test_lm_configs.py``
prints them; ``tiny``: 2 x 128, 4 heads, MLP 344, 0.46M to 0.73M parameters):

==============  =====  ======  ====  =====  ====  ======  =======
model           size   layers  dim   heads  mlp   params  vs size
==============  =====  ======  ====  =====  ====  ======  =======
transformer     125m       12   768     12  2048    134M    +7.3%
transformer     340m       24  1024     16  2736    368M    +8.2%
transformer     760m       24  1536     16  4096    778M    +2.3%
transformer     1.3b       24  2048     32  5504   1345M    +3.5%
deltanet        125m       12   768      6  2048    135M    +8.4%
deltanet        340m       24  1024      8  2736    372M    +9.3%
deltanet        760m       24  1536     12  4096    783M    +3.1%
deltanet        1.3b       24  2048     16  5504   1353M    +4.1%
gated_deltanet  125m       12   768      6  1728    134M    +7.0%
gated_deltanet  340m       24  1024      8  2368    370M    +8.8%
gated_deltanet  760m       24  1536     12  3520    777M    +2.2%
gated_deltanet  1.3b       24  2048     16  4736   1341M    +3.2%
ttt_linear      125m       12   768     12  1792    135M    +7.9%
ttt_linear      340m       24  1024     16  2368    368M    +8.3%
ttt_linear      760m       24  1536     16  3520    775M    +2.0%
ttt_linear      1.3b       24  2048     32  4800   1348M    +3.7%
ttt_mlp         125m       12   768     12  1600    134M    +7.0%
ttt_mlp         340m       24  1024     16  2240    370M    +8.8%
ttt_mlp         760m       24  1536     16  3328    779M    +2.5%
ttt_mlp         1.3b       24  2048     32  4608   1341M    +3.2%
titans          125m       12   768     12  1600    134M    +7.2%
titans          340m       24  1024     16  2176    366M    +7.6%
titans          760m       24  1536     16  3328    780M    +2.6%
titans          1.3b       24  2048     32  4608   1344M    +3.4%
titans_mac      125m        8   768     12  1856    134M    +7.2%
titans_mac      340m       16  1024     16  2560    369M    +8.4%
titans_mac      760m       16  1536     16  3840    779M    +2.6%
titans_mac      1.3b       16  2048     32  5312   1345M    +3.5%
titans_mag      125m        8   768     12  2048    133M    +6.3%
titans_mag      340m       16  1024     16  2736    360M    +6.0%
titans_mag      760m       16  1536     16  4096    760M    +0.1%
titans_mag      1.3b       16  2048     32  5504   1297M    -0.3%
titans_mal      125m        8   768     12  2048    133M    +6.3%
titans_mal      340m       16  1024     16  2736    360M    +6.0%
titans_mal      760m       16  1536     16  4096    760M    +0.1%
titans_mal      1.3b       16  2048     32  5504   1297M    -0.3%
atlas           125m       12   768     12  1536    135M    +7.7%
atlas           340m       24  1024     16  2112    368M    +8.2%
atlas           760m       24  1536     16  3200    781M    +2.7%
atlas           1.3b       24  2048     32  4544   1349M    +3.8%
hope            125m       12   768     12  1600    134M    +7.2%
hope            340m       24  1024     16  2176    366M    +7.7%
hope            760m       24  1536     16  3328    780M    +2.7%
hope            1.3b       24  2048     32  4608   1345M    +3.4%
==============  =====  ======  ====  =====  ====  ======  =======

Large chunks, a declared choice (LaCT's regime: Zhang et al. 2025, "Test-Time Training Done
Right", arXiv:2505.23884): the suffix ``-c<C>`` (``titans-125m-c2048``, ``ttt_mlp-small-c256``)
makes the neural memory (TTT-Linear, TTT-MLP, Titans, ATLAS) update once per chunk of ``C``
tokens, ``C`` in :data:`LARGE_CHUNKS` (``levels.memory.every = C``; the Titans step range
``0.05 / C`` a token, as at 16). Every token still reads the state after its own write (the
dual form); it is a different rule from ``every=16`` (C gradients at one state), not a faster
way to compute it.

Padded vocabularies: the embedding and the output head are padded to a multiple of
``model.vocab_multiple`` = 128 (Megatron's ``make-vocab-size-divisible-by`` default), the padded
logits masked to zero probability (:class:`nested.nn.models.MemoryLM`), so a tensor axis of any
size dividing 128 divides them: ``--config.task.vocab_size=50257`` (GPT-2's) trains on 50304
columns. 32000 and ``small``'s 8192 are multiples of 128 already: nothing is padded there.
``tiny`` keeps 1 (no padding): its 257 bytes would grow to 384 columns, half again the head's
work and parameters, and its numbers would change; on a tensor axis give it
``--config.model.vocab_multiple=8`` (264 columns) or 128.

Overrides as usual: ``--config.train.batch_size=64`` (``train.steps`` does not follow it),
``--config.task.vocab_size=50257``, ``--config.levels.memory.every=64``.
"""

from ml_collections import config_dict

from nested.run import config as nc

BATCH_TOKENS = 2**19  # 0.5M tokens a step
CHUNK = 16  # update chunk of the neural memories
VOCAB = 32000
PAPER_SIZES = ("125m", "340m", "760m", "1.3b")
NOMINAL = {"125m": 125e6, "340m": 340e6, "760m": 760e6, "1.3b": 1.3e9}  # parameters

# The backbone of each size (TTT's): layers x dim, attention heads, SwiGLU width.
SIZES = {
    "tiny": dict(layers=2, dim=128, heads=4, mlp_hidden=344),
    "small": dict(layers=4, dim=256, heads=4, mlp_hidden=688),
    "125m": dict(layers=12, dim=768, heads=12, mlp_hidden=2048),
    "340m": dict(layers=24, dim=1024, heads=16, mlp_hidden=2736),
    "760m": dict(layers=24, dim=1536, heads=16, mlp_hidden=4096),
    "1.3b": dict(layers=24, dim=2048, heads=32, mlp_hidden=5504),
}
HEADS_128 = {"125m": 6, "340m": 8, "760m": 12, "1.3b": 16}  # heads of width 128 (DeltaNet)

# Training setups: context, AdamW weight decay, peak lr, the end of the cosine (a fraction of
# the peak), warmup and the budget (tokens, or TTT's steps).
TTT = dict(
    seq_len=2048,
    weight_decay=0.1,
    lr={"125m": 3e-3, "340m": 1.5e-3, "760m": 1.25e-3, "1.3b": 1e-3},
    end_lr=1e-5,
    warmup_fraction=0.1,
    steps={"125m": 4800, "340m": 13500, "760m": 29000, "1.3b": 50000},
)
DELTANET = dict(
    seq_len=2048,
    weight_decay=0.01,
    lr=dict.fromkeys(PAPER_SIZES, 3e-4),
    min_lr_ratio=0.1,
    warmup_tokens=0.5e9,
    tokens={"125m": 2.5e9, "340m": 15e9, "760m": 30e9, "1.3b": 100e9},
)
GDN = dict(
    DELTANET,
    seq_len=4096,
    weight_decay=0.1,
    lr=dict.fromkeys(PAPER_SIZES, 4e-4),
    warmup_tokens=1e9,
)
TITANS = GDN  # Titans, ATLAS and Hope report the Gated DeltaNet setup
# The CPU sizes: ``tiny`` for tests (the bytes tokenizer), ``small`` for studies on one
# machine (RESULTS.md, "Language modelling on real text": a BPE of 8192); float32 compute.
CPU = {
    "tiny": dict(seq_len=64, vocab=257, batch_size=8, steps=200, lr=3e-3, warmup=20, window=32),
    "small": dict(seq_len=256, vocab=8192, batch_size=16, steps=150, lr=3e-3, warmup=15, window=64),
}
# model.vocab_multiple (the module docstring): 128, Megatron's and MaxText's, except at tiny
VOCAB_MULTIPLE = {"tiny": 1}

WINDOW = 512  # Titans MAC segment, MAG / MAL attention window
CMS_PERIODS = {"tiny": (16, 32, 64), "paper": (16, 64, 256)}  # Hope, fastest first (small: paper)
# The Titans memory's inner step range halved (the recipe's 0.1 / C a token), in every Titans
# model and Hope, and Hope's per-token memory gradient clipped to norm 1 (the module docstring)
TITANS_MEMORY = dict(rule="titans", every=CHUNK, lr_scale=0.05 / CHUNK)
MEMORY = {"memory": TITANS_MEMORY}

MODELS = {
    "transformer": dict(setup=GDN, model=dict(mixer="attention", window=None)),
    "deltanet": dict(
        setup=DELTANET,
        heads=HEADS_128,
        model=dict(output_gate=False),
        levels={"memory": dict(rule="delta")},
    ),
    "gated_deltanet": dict(setup=GDN, heads=HEADS_128, levels={"memory": dict(rule="gated_delta")}),
    "ttt_linear": dict(setup=TTT, levels={"memory": dict(rule="ttt_linear", every=CHUNK)}),
    "ttt_mlp": dict(setup=TTT, levels={"memory": dict(rule="ttt_mlp", every=CHUNK)}),
    "titans": dict(setup=TITANS, levels=MEMORY),
    "titans_mac": dict(setup=TITANS, model=dict(mixer="context", window=WINDOW), levels=MEMORY),
    "titans_mag": dict(setup=TITANS, model=dict(mixer="gate", window=WINDOW), levels=MEMORY),
    "titans_mal": dict(setup=TITANS, model=dict(mixer="layer", window=WINDOW), levels=MEMORY),
    "atlas": dict(setup=TITANS, levels={"memory": dict(rule="atlas", every=CHUNK)}),
    "hope": dict(setup=TITANS, hope=True),
}

# Backbones matched to the Transformer++ parameter count (module docstring): the SwiGLU width
# (a multiple of 64) or, for the hybrids, two thirds of the layers (and, for MAC, the width).
_HYBRID_LAYERS = {"125m": 8, "340m": 16, "760m": 16, "1.3b": 16, "small": 3}
ADJUSTED = {
    **{
        (model, size): dict(mlp_hidden=width)
        for model, widths in {
            "gated_deltanet": (1728, 2368, 3520, 4736),
            "ttt_linear": (1792, 2368, 3520, 4800),
            "ttt_mlp": (1600, 2240, 3328, 4608),
            "titans": (1600, 2176, 3328, 4608),
            "atlas": (1536, 2112, 3200, 4544),
            "hope": (1600, 2176, 3328, 4608),
        }.items()
        for size, width in zip(PAPER_SIZES, widths, strict=True)
    },
    **{
        (model, size): dict(layers=layers)
        for model in ("titans_mag", "titans_mal")
        for size, layers in _HYBRID_LAYERS.items()
    },
    # small (CPU studies): the memory mixers' gates and projections, matched the same way
    **{
        (model, "small"): dict(mlp_hidden=width)
        for model, width in {
            "gated_deltanet": 640,
            "ttt_linear": 640,
            "ttt_mlp": 576,
            "titans": 512,
            "atlas": 512,
            "hope": 512,
        }.items()
    },
    **{  # MAC's retrieval queries and persistent tokens need a narrower MLP too
        ("titans_mac", size): dict(layers=_HYBRID_LAYERS[size], mlp_hidden=width)
        for size, width in zip((*PAPER_SIZES, "small"), (1856, 2560, 3840, 5312, 576), strict=True)
    },
}
VARIANTS = tuple(f"{model}-{size}" for model in MODELS for size in SIZES)
LARGE_CHUNKS = (64, 128, 256, 512, 1024, 2048)  # the ``-c<C>`` suffix: one update per C tokens
CHUNKED = ("ttt_linear", "ttt_mlp", "titans", "atlas")  # models whose memory takes a suffix


def _hope(width: int, periods: tuple[int, ...]) -> tuple[dict, dict]:
    """Hope's model keys and levels: the memory owned by its projections, and the CMS."""
    names = tuple(f"cms{i}" for i in range(1, len(periods) + 1))
    model = dict(mixer="self_modifying", projections="projections", cms=names)
    levels = {
        "memory": dict(TITANS_MEMORY, owner="projections", clip=1.0),
        "projections": dict(rule="projections", every=CHUNK),
        **{
            name: dict(rule="cms", every=every, hidden=width // 2)
            for name, every in zip(names, periods, strict=True)
        },
    }
    return model, levels


def _schedule(setup: dict, size: str) -> dict:
    """Steps, peak lr, warmup and the cosine's end of ``setup`` at ``size``."""
    lr = setup["lr"][size]
    if "steps" in setup:  # TTT: steps, a warmup fraction, an absolute end lr
        steps = setup["steps"][size]
        warmup, ratio = round(setup["warmup_fraction"] * steps), setup["end_lr"] / lr
    else:
        steps = round(setup["tokens"][size] / BATCH_TOKENS)
        warmup = min(round(setup["warmup_tokens"] / BATCH_TOKENS), steps // 10)
        ratio = setup["min_lr_ratio"]
    return dict(steps=steps, learning_rate=lr, warmup_steps=warmup, min_lr_ratio=ratio)


def _large_chunk(variant: str) -> tuple[str, int | None]:
    """``<model>-<size>-c<C>`` -> (``<model>-<size>``, C); without the suffix, C is None."""
    head, _, tail = variant.rpartition("-c")
    if not head or not tail.isdigit():
        return variant, None
    model = head.rpartition("-")[0]
    if int(tail) not in LARGE_CHUNKS or model not in CHUNKED:
        raise nc.ConfigError(
            f"configs/lm.py:{variant}: a chunk suffix -c<C> takes C in {list(LARGE_CHUNKS)} "
            f"and a model of {list(CHUNKED)}"
        )
    return head, int(tail)


def get_config(arg=None):
    variant, large_chunk = _large_chunk(arg or "transformer-tiny")
    if variant not in VARIANTS:
        raise nc.ConfigError(
            f"configs/lm.py:{variant}: the variant is <model>-<size>, models {list(MODELS)}, "
            f"sizes {list(SIZES)}"
        )
    name, _, size = variant.rpartition("-")
    spec, cpu = MODELS[name], CPU.get(size)
    on_cpu = cpu is not None
    backbone = {**SIZES[size], **ADJUSTED.get((name, size), {})}
    if not on_cpu:
        backbone["heads"] = spec.get("heads", {}).get(size, backbone["heads"])
    model, levels = dict(spec.get("model", {})), spec.get("levels", {})
    if large_chunk is not None:
        memory = dict(levels["memory"], every=large_chunk)
        if "lr_scale" in memory:
            memory["lr_scale"] = memory["lr_scale"] * CHUNK / large_chunk
        levels = {**levels, "memory": memory}
    if spec.get("hope"):
        model, levels = _hope(backbone["mlp_hidden"], CMS_PERIODS.get(size, CMS_PERIODS["paper"]))
    if on_cpu and model.get("window"):
        model["window"] = cpu["window"]
    seq_len = cpu["seq_len"] if on_cpu else spec["setup"]["seq_len"]

    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config(
        "tokens", seq_len=seq_len, vocab_size=cpu["vocab"] if on_cpu else VOCAB
    )
    config.model = nc.model_config(
        "memory_lm",
        level="memory" if levels else None,
        vocab_multiple=VOCAB_MULTIPLE.get(size, 128),
        **backbone,
        **model,
    )
    config.levels = config_dict.ConfigDict(
        {level: nc.level_config(**fields) for level, fields in levels.items()}
    )
    if on_cpu:
        schedule = dict(
            steps=cpu["steps"],
            learning_rate=cpu["lr"],
            warmup_steps=cpu["warmup"],
            min_lr_ratio=0.1,
        )
        weight_decay, batch_size = 0.1, cpu["batch_size"]
    else:
        schedule = _schedule(spec["setup"], size)
        weight_decay, batch_size = spec["setup"]["weight_decay"], BATCH_TOKENS // seq_len
    steps = schedule.pop("steps")
    config.optimizer = nc.optimizer_config("adamw", weight_decay=weight_decay, b2=0.95, **schedule)
    every = 10 if on_cpu else 100
    config.train = nc.train_config(
        steps=steps,
        batch_size=batch_size,
        eval_batch_size=batch_size,
        log_every=every,
        eval_every=10 * every,
        eval_batches=2 if on_cpu else 16,
        checkpoint_every=10 * every,
        dtype="float32" if on_cpu else "bfloat16",
    )
    config.plasticity = nc.plasticity_config()
    return config
