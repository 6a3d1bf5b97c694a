"""The coordinator's detection: the watchdog's rounds, the detectors (pure functions of the model), cause attribution and diagnosis.

It reads the model and imports no stage above it (coordinator/detection/ruff.toml).
"""
