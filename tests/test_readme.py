"""README.md's Python example runs as written; its commands run as pasted."""

import re

import jax.numpy as jnp
import tiny_configs


def test_the_readme_example_trains_a_step_and_reads_the_fast_state():
    text = (tiny_configs.ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    metrics, logits, fast = namespace["metrics"], namespace["logits"], namespace["fast"]
    assert jnp.isfinite(metrics["loss"]) and 3.5 < float(metrics["loss"]) < 5.0  # ~log(64)
    assert logits.shape == (4, 32, 64)
    assert fast is not None


def test_every_readme_command_runs_as_pasted_in_a_fresh_shell():
    """Commands call the repository's virtual environment, never a bare ``python`` that a
    fresh shell (no venv activated) would not have the packages in."""
    text = (tiny_configs.ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert len(commands) > 20
    bare = [line for line in commands if re.match(r"\s*python\b(?!3 -m venv)", line)]
    assert bare == []
