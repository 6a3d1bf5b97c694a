"""The coordinator's ingest: agent streams and their sessions, report checks and admission, and the core that applies reports to the model.

It writes into the model and imports no stage above it (coordinator/ingest/ruff.toml).
"""
