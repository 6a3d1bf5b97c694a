"""Prometheus exposition, shared by the coordinator's /metrics and each agent's own.

``promtext`` writes the text format (0.0.4) fast enough for a cluster's worth
of samples per scrape, ``node_metrics`` holds the node-level families and how
a NodeReport becomes samples (so both daemons expose the same names), and
``http_server`` serves /metrics and /healthz from daemon threads.

Only the daemons import this package (``http_server`` needs
prometheus_client, the daemons' extra); it renders wire messages and reads
settings, and knows no component (``clusterwatch/exposition/ruff.toml``).
"""
