"""Contracts every process shares: what each side of a message agrees on, beyond the proto.

One table per module, each read by more than one process: ``limits`` (what a
message may hold, checked by the agent and the coordinator alike),
``grpc_status`` (errors to status codes, for every server), ``hook_handshake``
(the hook socket's credential handshake, as both ends speak it),
``collective_stats`` (bus-bandwidth factors and buckets, measured by the hook
and exported by the coordinator), ``job_labels`` and ``slurm_env`` (what a job's
labels may be, and how SLURM's environment names a job, for the hook and the
CLI), ``recovery_names`` (actions and launcher kinds, for config, API and
policy), ``gpu_reasons`` (the clock-event-reason bits of a GPU sample) and
``topology`` (link names and ranks, so every view ranks links the same way).

The hook imports some of these inside training processes, so this package
imports nothing of ours but ``clusterwatch.v1`` and ``clusterwatch.errors``,
and nothing beyond grpcio and protobuf (``clusterwatch/wire/ruff.toml``).
"""
