"""A tiny language model on a tiny corpus: the documents (:func:`document_texts`) prepared
(:func:`prepare`), the config of a one-layer DeltaNet LM of windows of ``T`` tokens on a
prepared folder (:func:`lm_config`), and a workdir of such a run without weights
(:func:`fake_run`)."""

import json
from pathlib import Path

import numpy as np
from ml_collections import config_dict

from nested.data import corpus
from nested.run import config as nc

T = 16


def document_texts(n: int = 40) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "é", "x", "longer-word"]
    return [" ".join(rng.choice(words, size=rng.integers(1, 9))) for _ in range(n)]


def prepare(root: Path, tokenizers: dict[str, tuple[str, int]]) -> dict[str, Path]:
    """``root/docs.jsonl`` of :func:`document_texts`, prepared (``val_fraction=0.3``) into
    ``root/name`` for each ``name: (tokenizer, vocab_size)``; ``{name: folder}``."""
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in document_texts()))
    out = {}
    for name, (kind, vocab) in tokenizers.items():
        out[name] = root / name
        corpus.prepare([str(docs)], out[name], tokenizer=kind, vocab_size=vocab, val_fraction=0.3)
    return out


def lm_config(path, persist: str = "sequence", vocab: int = 257) -> config_dict.ConfigDict:
    """A tiny DeltaNet LM on the prepared corpus ``path``."""
    config = config_dict.ConfigDict()
    config.seed = 0
    config.task = nc.task_config("tokens", path=str(path), seq_len=T, vocab_size=vocab)
    config.model = nc.model_config("memory_lm", level="memory", dim=16, heads=2, layers=1)
    config.levels = config_dict.ConfigDict({"memory": nc.level_config("delta", persist=persist)})
    config.optimizer = nc.optimizer_config("adamw", learning_rate=1e-3, warmup_steps=1)
    config.train = nc.train_config(
        steps=2,
        batch_size=4,
        log_every=1,
        eval_every=2,
        eval_batches=1,
        eval_batch_size=4,
        checkpoint_every=2,
    )
    config.plasticity = nc.plasticity_config()
    return config


def fake_run(folder, tmp_path, *, steps: bool = True):
    """A workdir with the config of a run on ``folder`` and a checkpoint folder (empty
    steps: every check happens before the checkpoint is read)."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    if steps:
        (workdir / "checkpoints" / "2").mkdir()
    exp = nc.build(lm_config(folder))
    (workdir / "config.json").write_text(exp.config.to_json_best_effort())
    return workdir
