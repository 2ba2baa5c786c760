"""What the tests share; no test module imports another.

* :mod:`helpers.tiny_configs`: the shipped configs made tiny, for the experiment workflow;
* :mod:`helpers.lm`: a tiny corpus and the DeltaNet LM config trained on it;
* :mod:`helpers.reference_linear`, :mod:`helpers.reference_neural`: the ops written from their
  equations; :mod:`helpers.reference_inner`: the inner loop as a per-token loop;
* :mod:`helpers.kernel_checks`: a kernel against the generic path on a random context;
* :mod:`helpers.hope`: a Hope LM compiled by hand;
* :mod:`helpers.companion`: the companion server's test key, raw requests, the tiny text run.

``tests/`` is on ``sys.path`` in the test session (pyproject's pytest ``pythonpath``) and on the
``PYTHONPATH`` of every process a test starts (``tests/conftest.py``), so ``from helpers import
tiny_configs`` works in a test, a subprocess and a config file a test writes.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
