"""Batched NVML field values: memory temperature, PCIe byte counters, NVLink counters.

All fields of one GPU are read with ONE ``nvmlDeviceGetFieldValues`` call per
interval. Each returned value carries its own ``nvmlReturn``: a field that
failed is left absent and counted as ``nvmlDeviceGetFieldValues:<FIELD NAME>``;
a field that is NotSupported is dropped from that GPU's batch for good, which
:meth:`FieldReader.unsupported` tells the backend (it then falls back to the
slow PCIe throughput call).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Final

from clusterwatch.agent.gpu.nvml_queries import PERMANENT_ERRORS, NvmlQueries, error_name
from clusterwatch.v1 import node_pb2

logger = logging.getLogger(__name__)

FIELD_VALUES: Final = "nvmlDeviceGetFieldValues"

_KIB: Final = 1024

# Device-wide fields: (pynvml constant name, GpuSample attribute, integer?).
# The PCIe byte counters replace nvmlDeviceGetPcieThroughput, which blocks for
# its 20 ms sampling window per call; the backend turns them into rates.
_DEVICE_FIELDS: Final = (
    ("NVML_FI_DEV_MEMORY_TEMP", "memory_temperature_celsius", False),
    ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "pcie_transmit_bytes_total", True),
    ("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", "pcie_receive_bytes_total", True),
)
# Per-link fields: (pynvml constant name, NvLinkSample attribute, multiplier).
# NVLink data throughput fields are counters in KiB (see pynvml's comments on
# NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX); error fields are plain counts.
_LINK_FIELDS: Final = (
    ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", "transmit_bytes_total", _KIB),
    ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", "receive_bytes_total", _KIB),
    ("NVML_FI_DEV_NVLINK_ERROR_DL_CRC", "crc_errors_total", 1),
    ("NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY", "replay_errors_total", 1),
    ("NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY", "recovery_errors_total", 1),
)
_LINK_COUNT: Final = "NVML_FI_DEV_NVLINK_LINK_COUNT"

# c_nvmlValue_t member to read for each NVML_VALUE_TYPE_* constant.
_VALUE_MEMBERS: Final = (
    ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
    ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
    ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
    ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
)


@dataclass(frozen=True)
class _Request:
    """One requested field: what to ask NVML for and where the answer goes."""

    label: str  # pynvml constant name, used in error counters
    field_id: int
    link: int | None  # None for device-wide fields
    target: str  # GpuSample / NvLinkSample attribute
    multiplier: int  # 0: store the value as a float (device-wide fields only)


@dataclass
class GpuFields:
    """The field batch of one GPU, fixed at start apart from dropped fields.

    Attributes:
        link_count: NVLink links this GPU reported at start (0 when unknown).
    """

    link_count: int
    requests: list[_Request] = field(default_factory=list)


class FieldReader:
    """Builds and decodes the per-GPU field-value batches.

    Args:
        nvml: the pynvml module object.
        queries: the shared query helper (error counting, switched-off queries).
    """

    def __init__(self, nvml: Any, queries: NvmlQueries) -> None:
        self._nvml = nvml
        self._queries = queries
        self._members: dict[int, str] = {getattr(nvml, name): member for name, member in _VALUE_MEMBERS}

    def prepare(self, index: int, handle: Any) -> GpuFields:
        """Reads the GPU's NVLink link count and builds its batch of field requests."""
        link_count = 0
        count_id = int(getattr(self._nvml, _LINK_COUNT))
        values = self._queries.call(index, FIELD_VALUES, handle, [count_id])
        if values is not None and len(values) == 1:
            decoded, _ = self._decode(values[0], _LINK_COUNT)
            if decoded is not None:
                link_count = max(0, int(decoded))
        requests = [
            _Request(name, int(field_id), None, target, 1 if integer else 0)
            for name, target, integer in _DEVICE_FIELDS
            # A pynvml older than the field cannot ask for it: same as unsupported.
            if (field_id := getattr(self._nvml, name, None)) is not None
        ]
        for link in range(link_count):
            requests.extend(
                _Request(name, int(getattr(self._nvml, name)), link, target, multiplier)
                for name, target, multiplier in _LINK_FIELDS
            )
        return GpuFields(link_count=link_count, requests=requests)

    def unsupported(self, index: int, fields: GpuFields, target: str) -> bool:
        """Whether the device-wide field feeding ``target`` can never be read on this GPU.

        True once the field came back NotSupported (or pynvml lacks it), or when
        the batched call itself is switched off for the GPU; False while it
        works or failed only transiently.
        """
        if self._queries.is_switched_off(index, FIELD_VALUES):
            return True
        return not any(request.link is None and request.target == target for request in fields.requests)

    def fill(self, index: int, handle: Any, fields: GpuFields, sample: node_pb2.GpuSample) -> dict[str, int]:
        """Reads the batch with one NVML call and fills ``sample`` with what came back.

        Returns:
            For each device-wide field that was read: its GpuSample attribute
            -> the value's ``timestamp`` (µs since 1970 as NVML says; 0 when
            NVML left it unset).
        """
        timestamps: dict[str, int] = {}
        if not fields.requests:
            return timestamps
        ids = [(request.field_id, request.link or 0) for request in fields.requests]
        values = self._queries.call(index, FIELD_VALUES, handle, ids)
        if values is None:
            return timestamps
        links: dict[int, node_pb2.NvLinkSample] = {}
        dropped: list[_Request] = []
        for request, value in zip(fields.requests, values, strict=False):
            decoded, permanent = self._decode(value, request.label)
            if decoded is None:
                if permanent:
                    dropped.append(request)
                continue
            if request.link is None:
                if request.multiplier:
                    setattr(sample, request.target, int(decoded) * request.multiplier)
                else:
                    setattr(sample, request.target, float(decoded))
                timestamps[request.target] = int(value.timestamp)
                continue
            link = links.get(request.link)
            if link is None:
                link = links[request.link] = node_pb2.NvLinkSample(link=request.link)
            setattr(link, request.target, int(decoded) * request.multiplier)
        sample.nvlinks.extend(links[link] for link in sorted(links))
        if dropped:
            fields.requests = [request for request in fields.requests if request not in dropped]
        return timestamps

    def _decode(self, value: Any, label: str) -> tuple[float | int | None, bool]:
        """Decodes one c_nvmlFieldValue_t by its valueType.

        Returns:
            (value, False) on success; (None, permanent) when the field failed,
            after counting the failure. ``permanent`` is True for errors after
            which the field is not asked for again.
        """
        if value.nvmlReturn != 0:
            error = self._return_name(int(value.nvmlReturn))
            self._queries.count(f"{FIELD_VALUES}:{label}", error)
            return None, error in PERMANENT_ERRORS
        member = self._members.get(int(value.valueType))
        if member is None:
            self._queries.count(f"{FIELD_VALUES}:{label}", "UnknownValueType")
            return None, False
        decoded: float | int = getattr(value.value, member)
        return decoded, False

    def _return_name(self, code: int) -> str:
        """Names an nvmlReturn code like the NVMLError subclass pynvml would raise for it."""
        try:
            exc: BaseException = self._nvml.NVMLError(code)
        except Exception:  # an unknown code must not break sampling
            return f"Return{code}"
        return error_name(exc)
