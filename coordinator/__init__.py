"""The coordinator: cluster state, event history, the gRPC API and /metrics."""
