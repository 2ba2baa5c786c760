"""Sample from a run: ``python experiments/sample.py --workdir DIR --prompt TEXT``.

Restores the latest checkpoint of ``--workdir`` (the model its ``config.json`` builds), feeds
the prompt and prints its continuation: ``--max_new_tokens`` tokens, greedy
(``--temperature=0``, the default) or drawn (``--temperature``, ``--top_k``, ``--seed``),
ending after any ``--stop`` token id (repeat the flag for several; the stop token is
printed). A char-LM run reads the prompt as UTF-8 bytes and prints text
(``nested.data.decode``); other tasks take and print token ids separated by spaces. Every
fast state starts fresh (as a sequence does) and is carried token by token. Everything is in
``nested.run.sampling``.
"""

import sys

import numpy as np
from absl import flags

from nested.data import decode
from nested.run import cli, loading, sampling

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run to sample from.")
_PROMPT = flags.DEFINE_string("prompt", None, "Text (char LM) or token ids to continue.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Draw from the k most likely tokens only.")
_STOP = flags.DEFINE_multi_integer("stop", [], "Token id that ends the continuation.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the draws.")
flags.mark_flags_as_required(["workdir", "prompt"])


def encode(prompt: str, text: bool) -> np.ndarray:
    """``prompt`` as token ids (1, L): its UTF-8 bytes when ``text``, else the ids it lists."""
    if text:
        return np.frombuffer(prompt.encode(), np.uint8).astype(np.int32)[None]
    try:
        return np.array([[int(token) for token in prompt.split()]], np.int32)
    except ValueError:
        sys.exit(f"error: --prompt={prompt!r}: this task takes token ids separated by spaces")


def main(argv):
    del argv
    with cli.user_errors():
        trained = loading.load_trained(_WORKDIR.value)
        text = trained.config.task.name == "char_lm"
        try:
            sample = sampling.generate(
                trained.program,
                trained.state.params,
                encode(_PROMPT.value, text),
                max_new_tokens=_MAX_NEW_TOKENS.value,
                temperature=_TEMPERATURE.value,
                top_k=_TOP_K.value,
                stop=_STOP.value,
                rng=_SEED.value,
            )
        except sampling.SamplingError as error:
            sys.exit(f"error: {error}")
    tokens = np.asarray(sample.tokens[0, : sample.lengths[0]])
    print(decode(tokens) if text else " ".join(map(str, tokens)))


if __name__ == "__main__":
    cli.run(main)
