"""Fixture nodes for topology tests: a sysfs tree and the fake NVML that goes with it.

Each node is ``tests/fixtures/topology/<name>/``: ``sys/`` (built by
``build_trees.py`` there, committed) and, where the node has GPUs,
``nvml.toml`` (what :class:`FakeNvml` shows). Start an agent on one::

    sys_root, nvml = fixture_node("hgx8")
    settings = AgentSettings(sys_root=sys_root, gpu_backend="nvml" if nvml else "none", ...)
    agent = Agent(settings, nvml=nvml)

or open the backend yourself: ``NvmlBackend(nvml)`` and
``discover_topology(backend, sys_root)``. To change files of a node (a port
going down), work on :func:`copy_fixture_node` in ``tmp_path``.
"""

from __future__ import annotations

import shutil
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pynvml

from fakes.fake_pynvml import FakeDevice, FakeNvLink, FakeNvml, h100, links_to_gpu, switch_links

FIXTURE_ROOT = Path(__file__).resolve().parent.parent / "fixtures" / "topology"
NODES = ("hgx8", "pcie4", "cpuonly", "nonic")


def fixture_node(name: str) -> tuple[Path, FakeNvml | None]:
    """The sysfs root of fixture node ``name`` and a fresh fake NVML of its GPUs (None: it has none).

    The tree is shared: do not write to it (see :func:`copy_fixture_node`).
    """
    return _node(FIXTURE_ROOT / name, name)


def copy_fixture_node(name: str, destination: Path) -> tuple[Path, FakeNvml | None]:
    """Like :func:`fixture_node`, on a copy at ``destination/<name>`` (symlinks kept as they are)."""
    copy = destination / name
    shutil.copytree(FIXTURE_ROOT / name, copy, symlinks=True)
    return _node(copy, name)


def _node(directory: Path, name: str) -> tuple[Path, FakeNvml | None]:
    sys_root = directory / "sys"
    if not sys_root.is_dir():
        raise FileNotFoundError(f"no fixture node {name!r} at {directory}")
    config = directory / "nvml.toml"
    if not config.exists():
        return sys_root, None
    with config.open("rb") as fh:
        return sys_root, fake_nvml_from(tomllib.load(fh), name)


def fake_nvml_from(config: dict[str, Any], node: str) -> FakeNvml:
    """A fake NVML as an ``nvml.toml`` describes it (see the comment at the top of one)."""
    gpus: list[dict[str, Any]] = config["gpus"]
    switches = config.get("nvswitches", ["00000000:C0:00.0"])
    devices = []
    for index, gpu in enumerate(gpus):
        device: FakeDevice = h100(index)
        device.uuid = f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'clusterwatch-fixture/{node}/{index}')}"
        device.name = gpu["name"]
        device.pci_bus_id = gpu["pci_bus_id"]
        if "nvlinks" in gpu:
            device.nvlink_table = _nvlinks(gpu["nvlinks"], gpus, switches)
        devices.append(device)
    fake = FakeNvml(devices)
    for index, row in enumerate(config["common_ancestor"]):
        for peer, level in enumerate(row):
            if peer != index and level != "X":
                fake.set_common_ancestor(index, peer, getattr(pynvml, f"NVML_TOPOLOGY_{level}"))
    return fake


def _nvlinks(spec: dict[str, int], gpus: list[dict[str, Any]], switches: list[str]) -> list[FakeNvLink]:
    table: list[FakeNvLink] = []
    for kind, count in spec.items():
        if kind == "switch":
            table += switch_links(count, switches)
        elif kind == "down":
            table += [FakeNvLink(switches[0], pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, enabled=False)] * count
        elif kind.startswith("gpu"):
            table += links_to_gpu(count, gpus[int(kind.removeprefix("gpu"))]["pci_bus_id"])
        else:
            raise ValueError(f"unknown kind of NVLink {kind!r}")
    return table
