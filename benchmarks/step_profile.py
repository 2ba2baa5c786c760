"""Where a compiled step's time and FLOPs go: a profiler trace joined to the optimised HLO.

``profile(fn, args, steps)`` runs ``fn(*args)`` (a jitted function, compiled by one call first)
``steps`` times under ``jax.profiler``, then attributes every executed HLO operation:

* time: the operation's own duration in the trace (the events XLA's runtime records per
  operation, ``hlo_op``; an operation's time excludes the operations nested in it, such as a
  loop's body), summed over its executions and divided by ``steps``;
* FLOPs: 2 x the multiply-adds of the matrix products (``dot``, ``convolution``) in the
  operation and the fusions it calls, read from the optimised HLO's shapes, times the
  operation's executions in the trace (loop bodies run once an iteration), divided by
  ``steps``. Elementwise work is not counted (as ``nested.run.flops`` counts);
* part: the innermost of the step's named scopes (``jax.named_scope``) in the operation's
  ``op_name`` metadata that :func:`part_of` knows, joined to the enclosing ones: for example
  ``inner.memory/reads`` for the dual-form reads of the level ``memory``;
* phase: ``forward`` (no ``transpose(`` in the op_name's first transformation),
  ``backward`` (under ``transpose(``), ``recompute`` (a ``jax.checkpoint`` block's forward
  run again inside the backward: ``rematted_computation``), ``update`` (outside the
  differentiated function: the optimizer, metrics).

On a CPU, XLA runs independent operations on several threads at once, so the summed time of
the operations can exceed the step's wall time; shares are of the summed time.
"""

from __future__ import annotations

import collections
import glob
import math
import re
import tempfile
import time
from typing import NamedTuple

import jax
from jax.profiler import ProfileData

# The named scopes of nested's code that are parts (the library's jax.named_scope names);
# ``inner.<level>`` scopes are matched by prefix.
SCOPES = (
    "embedding",
    "attention",
    "mlp",
    "cms",
    "cms_grads",
    "self_modifying",
    "coefficients",
    "gradients",
    "reads",
    "state_update",
    "projections",
    "head",
    "loss",
    "optimizer",
)
PHASES = ("forward", "recompute", "backward", "update")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_SHAPE = re.compile(r"[a-z]\w*\[([\d,]*)\]")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class Instruction(NamedTuple):
    op_name: str  # the op_name metadata ("" if none)
    flops: float  # of its own products (not of called computations)
    calls: tuple[str, ...]  # fused / called computations whose products it runs


def _dims(shape: str) -> list[int]:
    match = _SHAPE.search(shape)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _operands(rest: str, opcode: str) -> list[str]:
    inside = rest[rest.index(f" {opcode}(") + len(opcode) + 2 :]
    return re.findall(r"%([\w.\-]+)", inside.split(")", 1)[0])


def product_flops(rest: str, shapes: dict[str, str]) -> float:
    """2 x multiply-adds of a ``dot`` or ``convolution`` instruction (the text after ``=``;
    ``shapes``: the computation's instruction name -> result type): the output's elements
    times the contracted size (a dot's lhs contracting dims; a convolution's kernel elements
    over its output features)."""
    out = math.prod(_dims(rest))
    if " dot(" in rest:
        lhs = _dims(shapes[_operands(rest, "dot")[0]])
        contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        k = math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i) if contract else 1
        return 2.0 * out * k
    if " convolution(" in rest:
        kernel = _dims(shapes[_operands(rest, "convolution")[1]])
        labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
        features = kernel[labels.group(1).index("o")] if labels else 1
        return 2.0 * out * math.prod(kernel) / features
    return 0.0


def parse_hlo(text: str) -> dict[str, dict[str, Instruction]]:
    """The optimised HLO module's computations: name -> {instruction name -> Instruction}."""
    computations, current, shapes = {}, None, {}
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current, shapes = computations.setdefault(match.group(1), {}), {}
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            name, rest = match.groups()
            shapes[name] = rest.split(" ", 1)[0]
            op_name = _OP_NAME.search(rest)
            calls = tuple(_CALLS.findall(rest)) if " fusion(" in rest else ()
            current[name] = Instruction(
                op_name.group(1) if op_name else "", product_flops(rest, shapes), calls
            )
    return computations


def instruction_flops(computations) -> dict[str, tuple[str, float]]:
    """Instruction name -> (op_name, FLOPs of one execution, its fusions' products included)."""
    memo = {}

    def of(computation: str) -> float:
        if computation not in memo:
            memo[computation] = sum(
                ins.flops + sum(of(c) for c in ins.calls)
                for ins in computations.get(computation, {}).values()
            )
        return memo[computation]

    out = {}
    for body in computations.values():
        for name, ins in body.items():
            out[name] = (ins.op_name, ins.flops + sum(of(c) for c in ins.calls))
    return out


def part_of(op_name: str) -> str:
    """The known named scopes in ``op_name``, outermost first, joined by '/' ("other": none;
    an operation without an op_name, such as a loop's carry copies: "copies (no op_name)")."""
    parts = []
    for piece in re.split(r"[/()]", op_name):
        known = piece in SCOPES or piece.startswith("inner.")
        if known and (not parts or parts[-1] != piece):
            parts.append(piece)
    return "/".join(parts) or ("other" if op_name else "copies (no op_name)")


def phase_of(op_name: str) -> str:
    """forward, recompute, backward or update (module docstring)."""
    pieces = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    transform = next((p for p in pieces if "(" in p), "")
    if transform.startswith("transpose("):
        return "recompute" if "rematted_computation" in op_name else "backward"
    if transform.startswith("jvp("):
        return "forward"
    return "update"


def self_times(events) -> list[tuple[str, float]]:
    """(hlo_op, own nanoseconds) of one thread's events: nested operations' time subtracted."""
    ops = []
    for event in events:
        stats = dict(event.stats)
        if "hlo_op" in stats:
            ops.append((event.start_ns, event.start_ns + event.duration_ns, stats["hlo_op"]))
    ops.sort(key=lambda e: (e[0], -e[1]))
    out, stack = [], []  # stack of [end, name, own]
    for start, end, name in ops:
        while stack and stack[-1][0] <= start:
            done = stack.pop()
            out.append((done[1], done[2]))
        if stack:
            stack[-1][2] -= end - start
        stack.append([end, name, end - start])
    out += [(name, own) for _, name, own in stack]
    return out


class Row(NamedTuple):
    part: str
    phase: str
    seconds: float  # a step
    flops: float  # a step


def profile(fn, args, steps: int = 2) -> tuple[list[Row], dict]:
    """Rows of (part, phase) with seconds and FLOPs a step, and totals: ``wall`` (median step
    seconds under the profiler), ``op_seconds``, ``flops`` (the rows' sums) and ``xla_flops``
    (XLA's ``cost_analysis()`` of the compiled step, loop bodies counted once)."""
    compiled = fn.lower(*args).compile()
    table = instruction_flops(parse_hlo(compiled.as_text()))
    module = compiled.as_text().split("\n", 1)[0].split()[1].rstrip(",")
    jax.block_until_ready(fn(*args))
    walls = []
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(steps):
            with jax.profiler.StepTraceAnnotation("step"):
                began = time.perf_counter()
                jax.block_until_ready(fn(*args))
                walls.append(time.perf_counter() - began)
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
    seconds, flops = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            events = [e for e in line.events if dict(e.stats).get("hlo_module", module) == module]
            for name, own in self_times(events):
                op_name, per_run = table.get(name, ("", 0.0))
                key = (part_of(op_name), phase_of(op_name))
                seconds[key] += own * 1e-9 / steps
                flops[key] += per_run / steps
    rows = [Row(*key, seconds[key], flops[key]) for key in seconds]
    rows.sort(key=lambda r: -r.seconds)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    totals = {
        "wall": sorted(walls)[len(walls) // 2],
        "op_seconds": sum(r.seconds for r in rows),
        "flops": sum(r.flops for r in rows),
        "xla_flops": float((cost or {}).get("flops", float("nan"))),
    }
    return rows, totals


def tables(rows: list[Row], totals: dict, peak_tflops: float | None) -> list[str]:
    """Markdown: by phase, then by part (forward / backward+recompute columns)."""
    op = totals["op_seconds"] or 1.0
    rate = lambda f, s: f"{f / s / 1e9:,.1f}" if s > 0 and f > 0 else ""
    lines = [
        f"Step wall {totals['wall'] * 1e3:,.1f} ms under the profiler; operations' own time "
        f"summed {op * 1e3:,.1f} ms (threads overlap); products {totals['flops'] / 1e9:,.3f} "
        f"GFLOP a step from the trace (XLA cost_analysis, loop bodies once: "
        f"{totals['xla_flops'] / 1e9:,.3f}).",
        "",
        "| phase | ms a step | share | GFLOP | GFLOP/s |",
        "|---|--:|--:|--:|--:|",
    ]
    for phase in PHASES:
        s = sum(r.seconds for r in rows if r.phase == phase)
        f = sum(r.flops for r in rows if r.phase == phase)
        if s:
            lines.append(
                f"| {phase} | {s * 1e3:,.1f} | {s / op:.1%} | {f / 1e9:,.3f} | {rate(f, s)} |"
            )
    lines += [
        "",
        "| part | forward ms | backward ms | recompute ms | update ms | share | GFLOP | GFLOP/s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    parts = collections.defaultdict(dict)
    for r in rows:
        parts[r.part][r.phase] = r
    order = sorted(parts, key=lambda p: -sum(r.seconds for r in parts[p].values()))
    for part in order:
        by = parts[part]
        ms = lambda ph: f"{by[ph].seconds * 1e3:,.1f}" if ph in by else ""
        s = sum(r.seconds for r in by.values())
        f = sum(r.flops for r in by.values())
        lines.append(
            f"| {part} | {ms('forward')} | {ms('backward')} | {ms('recompute')} | "
            f"{ms('update')} | {s / op:.1%} | {f / 1e9:,.3f} | {rate(f, s)} |"
        )
    if peak_tflops:
        lines += ["", f"GFLOP/s against a peak of {peak_tflops * 1e3:,.0f} GFLOP/s."]
    return lines
