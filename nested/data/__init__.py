"""Data tasks: deterministic, resumable batches of numpy int32 tokens (no JAX, no downloads).

Every task is a frozen dataclass config with ``batch(index, batch_size, split=...)``: batch
number ``index`` of a split is a pure function of (seed, split, index), so the data position
of a run is just the index of its next batch. See ``nested.data.batch`` for the protocol.
"""

from nested.core.batch import Batch, as_arrays, check_arrays, check_tokens
from nested.data.batch import (
    STREAM_EXTRAS,
    Task,
    iterate,
    make_batch,
    render_example,
    rng_for,
    sample_without_replacement,
)
from nested.data.char_lm import CharLMTask, bits_per_char, decode, split_files
from nested.data.companion import CompanionTask
from nested.data.continual import ContinualTask
from nested.data.mqar import (
    ZOOLOGY_TEST_SETTINGS,
    ZOOLOGY_TRAIN_SETTINGS,
    MQARTask,
    mqar_sequences,
)
from nested.data.niah import NEEDLE, QUERY, NIAHTask
from nested.data.registry import TASKS, make_task
from nested.data.tokens import TokensTask, document_ids

__all__ = [
    "NEEDLE",
    "QUERY",
    "STREAM_EXTRAS",
    "TASKS",
    "ZOOLOGY_TEST_SETTINGS",
    "ZOOLOGY_TRAIN_SETTINGS",
    "Batch",
    "CharLMTask",
    "CompanionTask",
    "ContinualTask",
    "MQARTask",
    "NIAHTask",
    "Task",
    "TokensTask",
    "as_arrays",
    "check_arrays",
    "check_tokens",
    "bits_per_char",
    "decode",
    "document_ids",
    "iterate",
    "make_batch",
    "make_task",
    "mqar_sequences",
    "render_example",
    "rng_for",
    "sample_without_replacement",
    "split_files",
]
