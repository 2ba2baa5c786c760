"""The Agent Companion Model: a learning fast-weight memory per agent beside a frozen model.

Seed 000, section 6: a small neural learner beside a frozen foundation model, one persistent
*learning* state per agent, updated online from the agent's interactions.

* :mod:`~nested.companion.engine`: :class:`Companion`, the Python API (observe, recall,
  consolidate, forget, export and import of an agent), many agents in one jitted call; its
  parts: :mod:`~nested.companion.inputs` (what a request may hold, :class:`CompanionError`),
  :mod:`~nested.companion.text` (the tokenizer), :mod:`~nested.companion.agent_file` (the
  export file) and :mod:`~nested.companion.buckets` (the sizes of the jitted calls);
* :mod:`~nested.companion.store`: the per-agent states, :class:`SQLiteStore` by default;
* :mod:`~nested.companion.server`: the HTTP service (``experiments/serve.py``);
* :mod:`~nested.companion.mcp_server`: one agent's memory as MCP tools (``serve.py --mcp``);
* :mod:`~nested.companion.checks`: the requests both take, their limits and the error shape;
* :mod:`~nested.companion.client`: Python clients of them (HTTP, MCP) and a launcher of the
  server process.

The study that holds it against every fair baseline is research code, apart from the library:
``experiments/studies/companion`` (``experiments/companion_study.py``).
"""

from nested.companion.engine import Companion, CompanionError
from nested.companion.store import SQLiteStore, Store

__all__ = ["Companion", "CompanionError", "SQLiteStore", "Store"]
