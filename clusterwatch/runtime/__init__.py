"""Process plumbing every clusterwatch process shares: how it connects, retries, runs and is supervised.

``tls`` (mutual TLS for every gRPC endpoint), ``peer_identity`` and
``cert_terms`` (who a TLS peer is, from its certificate's role URI),
``grpc_options`` (channel and server options), ``backoff`` (reconnecting
with jitter), ``external_commands`` (py-spy, scontrol, kubectl from asyncio,
killed with what they started) and ``sd_notify`` (systemd's notify protocol).

The hook imports ``backoff`` and ``grpc_options`` inside training processes,
so nothing here is imported at package level, and a module that needs a
daemon's dependency (``peer_identity``: cryptography) is imported only by the
daemons. None of it renders metrics or text for people
(``clusterwatch/runtime/ruff.toml``).
"""
