"""Active probes between nodes: a small TCP server on every agent, and the client that measures a
path to a peer's (round trip, throughput) when the coordinator asks (ProbeCommand)."""
