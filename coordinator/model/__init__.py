"""The coordinator's model: cluster state, jobs and their step rings, checkpoints, the incident book, rates, the event log.

Pure state and its persistence: every other room reads and writes it, and it
imports none of them (coordinator/model/ruff.toml).
"""
