"""clusterwatch: watch multi-node PyTorch training and keep it running.

This package is what every process shares; the components (``clusterwatch.agent``,
``clusterwatch.coordinator``, ``clusterwatch.tui``) live in top-level folders of
the repository and import as subpackages of it. Shared code is grouped by kind:

* ``wire``: contracts every process agrees on beyond the proto (limits, the
  status table, the hook handshake, collective buckets, label and name tables);
* ``runtime``: process plumbing (TLS and peer identity, gRPC options, backoff,
  external commands, sd_notify);
* ``exposition``: Prometheus text, the node-level families, the /metrics server;
* ``text``: numbers and wiring as people read them (``status``, ``topology``, ``top``);
* ``v1`` and ``kubelet``: generated protobuf code;
* ``hook`` (inside training processes), ``cli`` (the command line) and ``sim``
  (``clusterwatch simulate``).

Only what is package-wide stays at this level: ``config`` (one settings
object per process, and users' own code reads it), ``errors`` (the hierarchy
every subsystem raises from), ``client`` (``ClusterClient``, the public client
of the ClusterService) and ``__main__``. Their import paths are public.
"""

__version__ = "0.1.0"
