"""Text for people: numbers, states and a node's wiring as ``status``, ``topology`` and ``top`` show them.

``humanize`` (byte sizes, durations, bandwidths, ages) and ``topology_render``
(a node's link matrix and the cluster's placements, as lines). Pure functions
from the API's messages to strings, so the command line, the TUI and the
coordinator's messages say the same thing the same way. No textual here: the
TUI draws, this package only writes (``clusterwatch/text/ruff.toml``).
"""
