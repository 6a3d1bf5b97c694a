"""The network namespace's interface addresses, with their prefix lengths (getifaddrs, via psutil)."""

from __future__ import annotations

import ipaddress
import socket

import psutil


def interface_addresses() -> dict[str, list[str]]:
    """``{interface: ["10.81.1.1/24", "fe80::1/64"]}`` of every IPv4 and IPv6 address here."""
    found: dict[str, list[str]] = {}
    for device, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6) or not address.netmask:
                continue
            try:
                ip = ipaddress.ip_address(address.address.partition("%")[0])  # fe80::1%eth0
                prefix = bin(int(ipaddress.ip_address(address.netmask))).count("1")
            except ValueError:
                continue
            found.setdefault(device, []).append(f"{ip}/{prefix}")
    return found


def device_by_ip(addresses: dict[str, list[str]]) -> dict[str, str]:
    """``{ip: interface}`` from interface_addresses()."""
    return {entry.partition("/")[0]: device for device, entries in addresses.items() for entry in entries}
