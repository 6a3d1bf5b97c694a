"""Channel and server options every clusterwatch gRPC endpoint uses."""

from __future__ import annotations

# Large enough for a full snapshot of a 10,000-node cluster's summaries.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Agents ping every 10 s so a dead coordinator (or a silently dropped
# connection) is noticed within ~15 s even when no report is in flight.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Our own backoff (uplink.Backoff) decides when to retry; keep gRPC's short.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

# The server accepts the agents' keepalive pings instead of answering them
# with GOAWAY "too_many_pings".
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
