"""Prepare a corpus: ``python experiments/prepare.py --input DATA --out DIR``.

Tokenizes text files, folders of them (read recursively) and ``.jsonl`` files (a ``text`` field
per line) into flat token shards ``DIR/<split>-<k:05d>.bin`` and ``DIR/index.json`` (format
``nested-tokens/1``), read by the task ``tokens`` (``--config.task.name=tokens
--config.task.path=DIR``). ``--tokenizer``: ``bytes`` (vocab 257, EOS 256), ``bpe`` (a byte-level
BPE of ``--vocab_size`` trained on the corpus, saved as ``DIR/tokenizer.json``) or the path of a
local ``tokenizer.json`` (EOS: ``--eos`` or a special token such as ``<|endoftext|>``). The
validation split takes documents by hash (``--val_fraction``). Bad input ends in one line,
``error: ...``, exit status 1, and nothing written. Everything is in ``nested.data.corpus``.

Example: ``python experiments/prepare.py --input notes/,more.jsonl --out data/notes
--tokenizer=bpe --vocab_size=8192``.
"""

import sys

from absl import flags

from nested.data import corpus
from nested.run import cli

_INPUT = flags.DEFINE_multi_string(
    "input", [], "Text file, folder (recursive) or .jsonl file; repeat or comma-separate."
)
_OUT = flags.DEFINE_string("out", None, "Folder to write the shards and index.json into.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "bytes, bpe, or a tokenizer.json path.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary of --tokenizer=bpe.")
_EOS = flags.DEFINE_string("eos", None, "End-of-document token of a tokenizer.json.")
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.01, "Share of documents held out as val.")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", 1 << 27, "Most tokens per shard file.")
_SKIP_BAD = flags.DEFINE_bool("skip_bad", False, "Skip binary / non-UTF-8 files and bad lines.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a corpus already in --out.")
flags.mark_flags_as_required(["out"])


def main(argv):
    del argv
    inputs = [part for value in _INPUT.value for part in value.split(",") if part]
    try:
        corpus.prepare(
            inputs,
            _OUT.value,
            tokenizer=_TOKENIZER.value,
            vocab_size=_VOCAB_SIZE.value,
            val_fraction=_VAL_FRACTION.value,
            shard_tokens=_SHARD_TOKENS.value,
            eos=_EOS.value,
            skip_bad=_SKIP_BAD.value,
            overwrite=_OVERWRITE.value,
            log=print,
        )
    except corpus.PrepareError as error:
        sys.exit(f"error: {error}")
    print(f"index: {_OUT.value}/{corpus.INDEX}")


if __name__ == "__main__":
    cli.run(main)
