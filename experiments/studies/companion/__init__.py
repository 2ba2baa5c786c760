"""The Agent Companion study: the learning memory against every fair baseline on held-out
agents (``experiments/companion_study.py``)."""
