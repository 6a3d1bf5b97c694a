"""The coordinator's recovery: the policy, the executor that carries out its decisions, operator actions, and the launchers.

It consumes detection's incidents and acts on the model through the core; it
imports neither the API nor what serves /metrics (coordinator/recovery/ruff.toml).
"""
