"""README.md's Python example runs as written, after the two commands it opens with."""

import re

import jax.numpy as jnp
from helpers import tiny_configs


def test_the_readme_example_trains_a_step_and_reads_the_fast_state():
    text = (tiny_configs.ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    metrics, logits, fast = namespace["metrics"], namespace["logits"], namespace["fast"]
    assert jnp.isfinite(metrics["loss"]) and 3.5 < float(metrics["loss"]) < 5.0  # ~log(64)
    assert logits.shape == (4, 32, 64)
    assert fast is not None


def test_the_readme_opens_with_the_two_commands_and_fits_a_first_page():
    """One fenced block of two lines first: the default experiment, then the test command that
    CI runs (``.ci/run``); at most 150 lines, linking every reference page of ``docs/``
    (their commands: ``tests/docs/test_docs.py``)."""
    text = (tiny_configs.ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert lines[0] == lines[3] == "```" and lines[4] == ""
    train, test = lines[1:3]
    assert train.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && ")
    assert train.endswith(" experiments/train.py --config configs/mqar.py --workdir runs/mqar")
    ci = (tiny_configs.ROOT / ".ci" / "run").read_text()
    assert f'test_command="{test}"' in ci
    assert len(lines) <= 150
    docs = sorted((tiny_configs.ROOT / "docs").glob("*.md"))
    assert len(docs) >= 4
    assert [doc.name for doc in docs if f"](docs/{doc.name})" not in text] == []
