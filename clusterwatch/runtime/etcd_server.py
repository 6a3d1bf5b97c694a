"""A real etcd (Debian's ``etcd-server``) on loopback ports, for `clusterwatch demo --coordinators N`, tests and benchmarks."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import grpc

from clusterwatch.etcd import rpc_pb2, rpc_pb2_grpc

START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A loopback port the OS picked and released (etcd cannot listen on port 0 and say which)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class EtcdServer:
    """One etcd member in ``workdir``, serving clients on ``endpoint``; ``stop()`` ends it.

    Args:
        tls: (certificate, key, CA) PEM files: serve clients over https and require a client
            certificate signed by the CA.

    Raises:
        RuntimeError: it exited or did not serve within START_TIMEOUT_S (with its log's tail).
    """

    def __init__(
        self,
        workdir: Path,
        binary: str = "etcd",
        name: str = "clusterwatch",
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        scheme = "https" if tls else "http"
        client, peer = f"{scheme}://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self._tls = tls
        self.endpoint = client
        self.log = workdir / "etcd.log"
        argv = [
            binary,
            "--name", name,
            "--data-dir", str(workdir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{name}={peer}",
        ]  # fmt: skip
        if tls:
            cert, key, ca = tls
            argv += ["--cert-file", str(cert), "--key-file", str(key), "--trusted-ca-file", str(ca)]
            argv.append("--client-cert-auth")
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        address = self.endpoint.split("://", 1)[1]
        if self._tls:
            cert, key, ca = (path.read_bytes() for path in self._tls)
            credentials = grpc.ssl_channel_credentials(ca, key, cert)
            channel = grpc.secure_channel(address, credentials)
        else:
            channel = grpc.insecure_channel(address)
        with channel:
            kv = rpc_pb2_grpc.KVStub(channel)
            while True:
                try:
                    kv.Range(rpc_pb2.RangeRequest(key=b"/"), timeout=1)
                    return
                except grpc.RpcError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        tail = self.log.read_text(errors="replace")[-2000:]
                        raise RuntimeError(
                            f"etcd did not start (exit code {self.process.poll()}):\n{tail}"
                        ) from None
                    time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
