"""The plain terms of a clusterwatch certificate: who holds it (role URI) and how long a trial one lasts.

Kept apart from ``clusterwatch.runtime.peer_identity`` and ``clusterwatch.cli.certs``,
which need the ``cryptography`` package, so that the command line can build
its parser where only the training hook is installed (``pip install
clusterwatch``, without the ``coordinator`` extra; README, "Running it on a cluster").
"""

from __future__ import annotations

import enum

SCHEME = "clusterwatch"
"""The URI scheme of the one SAN that says who a certificate's holder is."""

CA_DAYS = 3650
LEAF_DAYS = 397  # the longest a public CA may issue for; short enough to notice rotation
MAX_DAYS = 36500


class Role(enum.StrEnum):
    """What a certificate's holder is; the value is the URI's host part."""

    NODE = "node"
    USER = "user"
    COORDINATOR = "coordinator"


def role_uri(role: Role, name: str) -> str:
    """The URI SAN that makes a certificate ``role`` ``name``."""
    return f"{SCHEME}://{role.value}/{name}"
