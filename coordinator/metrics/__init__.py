"""The coordinator's /metrics: Prometheus families rendered at scrape time from views and counts.

The top of the read side: it reads the model, the views and the counts of
detection and recovery, and imports neither ingest nor the API
(coordinator/metrics/ruff.toml).
"""
