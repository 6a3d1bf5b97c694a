"""`clusterwatch sd-file` keeps Prometheus' file_sd list of a group's coordinators as they join and leave
(coordinator/group/sd_file.py), against a real etcd and real coordinators."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from etcd_server import EtcdServer
from helpers import clusterwatch_cmd, eventually, run_cli

from clusterwatch.config import CoordinatorSettings
from clusterwatch.coordinator.server import CoordinatorServer

pytestmark = pytest.mark.timeout(90)


def coordinator(tmp_path: Path, etcd: EtcdServer, prefix: str, shard_id: str) -> CoordinatorServer:
    return CoordinatorServer(
        CoordinatorSettings(
            listen="127.0.0.1:0",
            metrics_listen="127.0.0.1:0",
            advertise="127.0.0.1:0",  # the gRPC port; /metrics listed on 127.0.0.1
            state_dir=tmp_path / shard_id,
            etcd=etcd.endpoint,
            etcd_prefix=prefix,
            shard_id=shard_id,
        )
    )


def targets(path: Path) -> list[str]:
    try:
        groups = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [t for group in groups for t in group["targets"]]


async def test_the_file_lists_every_coordinator_and_follows_joins_and_leaves(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    sd = tmp_path / "coordinators.json"
    first = coordinator(tmp_path, etcd, etcd_prefix, "c1")
    await first.start()
    second = coordinator(tmp_path, etcd, etcd_prefix, "c2")
    writer = await asyncio.create_subprocess_exec(
        *clusterwatch_cmd("sd-file", str(sd), "--etcd", etcd.endpoint, "--etcd-prefix", etcd_prefix),
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        one = f"127.0.0.1:{first.metrics_port}"
        assert first.membership is not None
        assert first.membership.me.address == f"127.0.0.1:{first.grpc_port}"  # advertised port 0: gRPC's
        await eventually(lambda: targets(sd) == [one], 30, "the file to list c1")
        await second.start()
        two = f"127.0.0.1:{second.metrics_port}"
        await eventually(lambda: sorted(targets(sd)) == sorted([one, two]), 30, "the file to list c1 and c2")
        await second.stop()
        await eventually(lambda: targets(sd) == [one], 30, "the file to drop c2 once it left")
        once = await asyncio.to_thread(
            run_cli,
            "sd-file",
            str(tmp_path / "once.json"),
            "--etcd",
            etcd.endpoint,
            "--etcd-prefix",
            etcd_prefix,
            "--once",
        )
        assert once.returncode == 0, once.stderr
        assert targets(tmp_path / "once.json") == [one]
    finally:
        writer.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(writer.communicate(), 30)
        await first.stop()
    assert writer.returncode == 0, stderr.decode()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
