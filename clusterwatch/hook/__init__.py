"""The training hook: runs inside every training process and reports to the node's agent.

``TrainingMonitor`` is for plain PyTorch loops; ``clusterwatch.hook.lightning``
and ``clusterwatch.hook.transformers`` hold callbacks for PyTorch Lightning and
Hugging Face ``Trainer``; ``current_monitor()`` is the monitor this process
already has (the one ``clusterwatch run`` created); ``BalancedBatchSampler`` splits each
step's global batch by the ranks' speeds (clusterwatch/hook/balance.py). Importing this
package imports neither torch nor the frameworks; they are imported when a monitor is created.
"""

from clusterwatch.hook.balance import BalancedBatchSampler
from clusterwatch.hook.monitor import TrainingMonitor, current_monitor

__all__ = ["BalancedBatchSampler", "TrainingMonitor", "current_monitor"]
