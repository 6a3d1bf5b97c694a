"""The coordinator: one room per stage (model, ingest, detection, recovery, views, metrics, api), wired by server.py."""
