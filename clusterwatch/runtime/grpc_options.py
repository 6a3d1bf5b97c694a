"""Channel and server options every clusterwatch gRPC endpoint uses."""

from __future__ import annotations

# What one message up may hold: a server accepts no more, a client sends no
# more. The largest honest one is a node report of a CPU node with 128 ranks
# of 512 steps each (the agent's default cap), 2.7 MB; an 8-GPU node with
# 8 ranks of 50 steps sends 24 KB, a BeginJob naming 10,000 nodes ~200 KB.
# It also bounds what one hostile message costs a server to parse
# (several times its size in memory). gRPC Python has one receive limit per
# server, not per method (per-method limits in a service config are enforced
# by clients, which a hostile client ignores), so the coordinator's agent
# stream and its API share this one.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
# What one message down may hold: a server sends no more, a client accepts no
# more. A full snapshot of a 10,000-node cluster is ~64 MB (6.4 KB per 8-GPU
# node), its summary (GetSnapshot summary_only, Watch) ~15 MB.
MAX_RESPONSE_BYTES = 128 * 1024 * 1024

# Agents ping every 10 s so a dead coordinator (or a silently dropped
# connection) is noticed within ~15 s even when no report is in flight.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
    # Our own backoff (uplink.Backoff) decides when to retry; keep gRPC's short.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

# The server accepts the agents' keepalive pings instead of answering them
# with GOAWAY "too_many_pings".
SERVER_OPTIONS: list[tuple[str, int]] = [
    # A taken port is an error, not a share of it (runtime/listen.py).
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
]
