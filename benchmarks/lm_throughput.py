"""Training throughput and MFU of the language models of ``configs/lm.py``.

    .venv/bin/python benchmarks/lm_throughput.py --models=transformer,deltanet,titans \\
        --size=tiny --steps=3 [--mesh=-1,1,1] [--batch_size=8] [--nowrite]
    .venv/bin/python benchmarks/lm_throughput.py --cpu_devices=2 --mesh=2,1,1 --models=titans
    .venv/bin/python benchmarks/lm_throughput.py --profile --models=hope --size=small

A model may carry the large-chunk suffix of ``configs/lm.py`` (``titans-c256``: the memory
updates once per 256 tokens, a declared rule of its own). For each model at ``--size`` on the
mesh ``--mesh`` (``data,fsdp,tensor`` sizes, -1: the devices the others leave): the jitted
training step of the training loop (``nested.run.pieces.make_layout``, ``init_state``,
``make_train_fn``: one outer step a call) on synthetic batches of the config's shape (random
token ids; with ``task.documents`` one document start in the middle of every row, on the
program's document grid, none where the grid is the row, so the kernels run their document
path as in training), compiled by a first call, then the median wall time of ``--steps``
timed calls.

* tokens/s = batch_size x seq_len / median step seconds;
* FLOPs/token: ``nested.run.flops.per_token(config)["train"]``, the analytic training FLOPs
  (forward x 3 but for the ops with written-out derivatives; attention over the pairs
  attended, causal or windowed; inner loops included; no remat recomputation, no document
  overhead: model FLOPs);
* TFLOP/s = tokens/s x FLOPs/token; MFU = TFLOP/s / (devices x peak per device). On CPU the
  peak is this machine's float32 2048x2048 matmul rate measured in the same run (median of
  7; simulated CPU devices share those cores, so MFU there is against one machine's peak);
  on GPU/TPU the nominal dense bf16 peak of the device kind (:data:`PEAK_TFLOPS`, vendor
  figures), or ``--peak_tflops``.

Prints a markdown table and writes it into this benchmark's section of benchmarks/README.md
(``--nowrite``: printed only).

``--profile``: instead of the table, where each model's training step spends its time and
FLOPs, by phase (forward, backward, recomputation, update) and by part (the named scopes of
the model: attention, MLP, each level's inner loop ``inner.<level>`` with its gradients,
momentum/decay ``coefficients``, ``reads`` and ``state_update``, CMS blocks and their span
gradients ``cms_grads``, Hope's ``self_modifying`` projections, the head, the optimizer), from
a ``jax.profiler`` trace of ``--steps`` steps joined to the compiled step's HLO
(``step_profile.py``). Written to the section ``lm_profile``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

# Simulated CPU devices must be requested before JAX starts.
for _arg in sys.argv[1:]:
    if _arg.startswith("--cpu_devices="):
        _count = int(_arg.split("=", 1)[1])
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_count}"
        ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import report  # noqa: E402
import step_profile  # noqa: E402
from absl import app, flags  # noqa: E402

from nested import data  # noqa: E402
from nested.run import config as nc  # noqa: E402
from nested.run import flops, pieces  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["transformer", "deltanet", "titans"], "Models of configs/lm.py.")
flags.DEFINE_string("size", "tiny", "Size of configs/lm.py (tiny, small, 125m, ...).")
flags.DEFINE_list("mesh", ["-1", "1", "1"], "data,fsdp,tensor mesh sizes (-1: the rest).")
flags.DEFINE_integer("steps", 3, "Timed training steps (after one compiling call).")
flags.DEFINE_integer("batch_size", None, "Sequences a step (default: the config's).")
flags.DEFINE_integer("seq_len", None, "Tokens a sequence (default: the config's).")
flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s per device (default: measured / table).")
flags.DEFINE_integer("cpu_devices", None, "Simulated CPU devices (XLA flag, set before JAX).")
flags.DEFINE_boolean("write", True, "Write the table into benchmarks/README.md.")
flags.DEFINE_string("section", None, "The README section (default lm_throughput / lm_profile).")
flags.DEFINE_boolean("profile", False, "Per-part time and FLOPs of each model's step instead.")

# Nominal dense bf16 peaks per device, TFLOP/s (vendor figures: NVIDIA's H100/H200 SXM and
# A100 datasheets without sparsity, Google Cloud's TPU pages), by a substring of device_kind.
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("v6 lite", 918.0),
    ("v6e", 918.0),
    ("v5 lite", 197.0),
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("v5", 459.0),
    ("v4", 275.0),
)


def nominal_peak(device_kind: str) -> float | None:
    """The table's peak TFLOP/s for ``device_kind`` (None: not in the table)."""
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_kind.lower():
            return peak
    return None


def synthetic_batches(exp, batch_size: int, steps: int, seed: int = 0) -> list[dict]:
    """``steps`` batches shaped as the task's, each stacked as one step of a call."""
    task, rng = exp.task, np.random.default_rng(seed)
    T = task.seq_len
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, task.vocab_size, (batch_size, T + 1), dtype=np.int32)
        extras = {}
        if getattr(task, "documents", False):
            documents = np.zeros((batch_size, T), np.int32)
            grid = exp.program.document_grid  # the start at the middle, on the program's grid
            documents[:, max(grid, T // 2 // grid * grid) :] = 1
            extras["documents"] = documents
        batch = data.make_batch(
            tokens[:, :-1], tokens[:, 1:], np.ones((batch_size, T), np.float32), **extras
        )
        arrays = data.as_arrays(batch, extras=data.STREAM_EXTRAS)
        exp.program.check_batch(arrays)  # the start lies on the program's document grid
        out.append({k: v[None] for k, v in arrays.items()})
    return out


def parameters(exp) -> int:
    abstract = jax.eval_shape(lambda: exp.program.init(jax.random.key(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))


def build_step(model: str):
    """The model's experiment, jitted training step, initial state and ``--steps + 1``
    batches placed on the mesh, from its config and the flags."""
    name, _, chunk = model.partition("-c")  # titans-c256: configs/lm.py:titans-<size>-c256
    config = nc.load(f"configs/lm.py:{name}-{FLAGS.size}" + (f"-c{chunk}" if chunk else ""))
    if FLAGS.batch_size:
        config.train.batch_size = config.train.eval_batch_size = FLAGS.batch_size
    if FLAGS.seq_len:
        config.task.seq_len = FLAGS.seq_len
    config.train.mesh.data, config.train.mesh.fsdp, config.train.mesh.tensor = map(int, FLAGS.mesh)
    exp = nc.build(config)
    layout = pieces.make_layout(exp)
    state = pieces.init_state(exp, layout)
    step = pieces.make_train_fn(exp.program, layout)
    B = config.train.batch_size
    batches = [layout.put(b, B, stacked=True) for b in synthetic_batches(exp, B, FLAGS.steps + 1)]
    return exp, layout, step, state, batches


def measure(model: str) -> dict:
    """One model's row: its config built with the flags, timed and counted."""
    exp, layout, step, state, batches = build_step(model)
    B = exp.config.train.batch_size
    began = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, batches[0]))
    compile_s = time.perf_counter() - began
    seconds = []
    for batch in batches[1:]:
        began = time.perf_counter()
        state, _ = jax.block_until_ready(step(state, batch))
        seconds.append(time.perf_counter() - began)
    mesh = layout.mesh
    return {
        "model": model,
        "mesh": "x".join(str(mesh.shape[a]) for a in mesh.axis_names),
        "devices": mesh.size,
        "params": parameters(exp),
        "flops": flops.per_token(exp)["train"],
        "tokens_per_s": B * exp.task.seq_len / statistics.median(seconds),
        "compile_s": compile_s,
    }


def profile(model: str, out: report.Report, peak: float | None) -> None:
    """Print the per-part breakdown of ``model``'s training step (``step_profile``)."""
    exp, _, step, state, batches = build_step(model)
    rows, totals = step_profile.profile(step, (state, batches[0]), steps=FLAGS.steps)
    tokens = exp.config.train.batch_size * exp.task.seq_len
    analytic = flops.per_token(exp)["train"] * tokens
    out.print(
        f"### {model}-{FLAGS.size}: {tokens:,} tokens a step, analytic "
        f"{analytic / 1e9:,.3f} GFLOP a step (nested.run.flops)"
    )
    out.print()
    for line in step_profile.tables(rows, totals, peak):
        out.print(line)
    out.print()


def main(argv):
    del argv
    devices = jax.devices()
    kind = devices[0].device_kind
    machine_peak = devices[0].platform == "cpu" and not FLAGS.peak_tflops
    out = report.Report(FLAGS.section or ("lm_profile" if FLAGS.profile else "lm_throughput"))
    if FLAGS.peak_tflops:
        peak, source = FLAGS.peak_tflops, "a device, --peak_tflops"
    elif machine_peak:  # simulated CPU devices share the machine's cores
        peak = out.gflops / 1e3
        source = "the machine (all its devices), float32 2048x2048 matmul measured in this run"
    else:
        peak, source = nominal_peak(kind), "a device, nominal dense bf16 (vendor figure)"
    out.print(
        f"{len(devices)} device(s) ({kind}). Peak: "
        f"{'n/a' if peak is None else f'{peak:.3f}'} TFLOP/s, {source}."
    )
    if FLAGS.profile:
        out.print(f"{FLAGS.steps} profiled steps after a compiling one.")
        out.print()
        for model in FLAGS.models:
            profile(model, out, peak)
        if FLAGS.write:
            out.write()
        return
    out.print(
        "FLOPs/token: analytic training FLOPs (nested.run.flops.per_token, causal attention, "
        f"inner loops included, no remat); {FLAGS.steps} timed steps after a compiling one, "
        "median."
    )
    out.print()
    out.print(
        "vs Transformer++: the row's MFU over the transformer's and its step time over the "
        "transformer's (tokens/s ratio), both measured in this run (the transformer first)."
    )
    out.print()
    out.print(
        "| model | size | mesh | params | FLOPs/token | tokens/s | TFLOP/s | MFU | "
        "MFU vs Transformer++ | step time vs Transformer++ |"
    )
    out.print("|---|---|---|---|---|---|---|---|---|---|")
    baseline = None  # the transformer's (MFU, tokens/s)
    for model in FLAGS.models:
        row = measure(model)
        achieved = row["tokens_per_s"] * row["flops"] / 1e12
        whole = None if peak is None else peak * (1 if machine_peak else row["devices"])
        mfu = None if whole is None else achieved / whole
        if model == "transformer":
            baseline = (mfu, row["tokens_per_s"])
        relative = step = ""
        if baseline is not None:
            relative = "" if mfu is None else f"{mfu / baseline[0]:.2f}"
            step = f"{baseline[1] / row['tokens_per_s']:.2f}x"
        line = (
            f"| {model} | {FLAGS.size} | {row['mesh']} | {row['params'] / 1e6:.2f}M | "
            f"{row['flops'] / 1e6:,.1f}M | {row['tokens_per_s']:,.0f} | {achieved:.4f} | "
            f"{'n/a' if mfu is None else f'{mfu:.1%}'} | {relative} | {step} |"
        )
        out.print(line)
    if FLAGS.write:
        out.write()


if __name__ == "__main__":
    app.run(main)
