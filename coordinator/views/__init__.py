"""Read-side copies of the model: node, job and topology views, taken on the event loop and read anywhere.

The API's answers and /metrics are built from them. They read the model (and
detection's placement advice) and import neither ingest, recovery, the API nor
/metrics (coordinator/views/ruff.toml).
"""
