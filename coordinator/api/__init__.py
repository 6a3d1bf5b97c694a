"""The coordinator's gRPC API: the thin servicers, who may call what, request checks, and the error mapping.

The top of the stack beside /metrics: it may import every stage below it, but
neither /metrics nor the composition root (coordinator/api/ruff.toml).
"""
