"""Times ``torch.distributed`` collectives and DDP gradient buckets inside the training process.

``CollectiveTracker`` is the entry point; each of its parts has its own module,
whose docstring says what it sees and what it does not:

- ``patches``: ``install()`` patches the collective functions of
  ``torch.distributed`` and ``Work.wait``, process-wide.
- ``calls``: times each patched call, synchronous or async, and the Work of an
  async one.
- ``ddp_timing``: ``watch_ddp()`` times DDP gradient buckets through the
  reducer's process group (``ddp_group``), or with a comm hook where that
  group cannot be swapped in.
- ``ledger``: launches in flight, sequence numbers, blocked time and
  aggregates (``aggregate``); what the monitor reads (``in_flight()``,
  ``last_failed()``, ``poll()``, ``take_step()``).
- ``ops``: the functions timed, the op names they report, and where each takes
  its data.
- ``cuda_timing``: collectives on CUDA tensors are timed with CUDA events read
  later with ``query()``, never a synchronisation.

First duty: do no harm. Every piece of bookkeeping runs in ``try`` and hands its
failure to ``on_error``; the user's collective always runs exactly as it would
without the hook, raising its own exceptions and returning its own values. One
lock guards the shared state and is only held for dictionary updates. Importing
this module does not import torch.
"""

from __future__ import annotations

from clusterwatch.hook.collectives.ddp_timing import _DdpTiming
from clusterwatch.hook.collectives.ledger import CollectiveTimingError, InFlight
from clusterwatch.hook.collectives.ops import _OP_SPECS, DDP_OP  # noqa: F401  (_OP_SPECS: read by the tests)
from clusterwatch.hook.collectives.patches import _ProcessPatches

__all__ = ["DDP_OP", "CollectiveTimingError", "CollectiveTracker", "InFlight"]


class CollectiveTracker(_ProcessPatches, _DdpTiming):
    """Times collectives and DDP buckets; see the module docstring.

    Thread safety: collectives may run on any thread, completion callbacks run
    on the backend's threads, ``in_flight()`` and ``poll()`` on the heartbeat
    thread; one lock, held only for dictionary updates, guards the shared
    state. No public method raises: failures go to ``on_error``.

    Args:
        on_error: Receives every exception of the hook's own bookkeeping; it
            must not block. The collective concerned runs normally.
        cuda: How CUDA events are made (default: ``CudaEvents()``, real ones);
            tests pass a stand-in to run the CUDA bookkeeping without a GPU.
        on_failure: Called (on the thread whose collective raised, before the
            exception goes on) when a timed collective raises; ``last_failed()``
            then says which. It must not block: the monitor only wakes its
            heartbeat thread.
    """
