"""README.md's Python example runs as written."""

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
