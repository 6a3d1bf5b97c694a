"""The tests' etcd: clusterwatch.runtime.etcd_server.EtcdServer, one per session (keys under a prefix
per test), and when its absence skips or fails a test.

Imported as ``etcd_server``. ``./dev test`` installs Debian's ``etcd-server`` package when it runs as
root; elsewhere the tests that need it skip with the reason, except under CI (``CI`` set), where a
missing etcd fails them.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_server import require

from clusterwatch.runtime.etcd_server import EtcdServer

__all__ = ["EtcdServer", "start_etcd"]


def start_etcd(workdir: Path, tls: tuple[Path, Path, Path] | None = None) -> EtcdServer:
    """Args: tls: (certificate, key, CA): https, client certificates required."""
    return EtcdServer(workdir, binary=require("etcd", package="etcd-server"), tls=tls)
