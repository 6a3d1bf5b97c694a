"""The training hook: runs inside every training process and reports to the node's agent.

``TrainingMonitor`` is for plain PyTorch loops; ``clusterwatch.hook.lightning``
and ``clusterwatch.hook.transformers`` hold callbacks for PyTorch Lightning and
Hugging Face ``Trainer``. Importing this package imports neither torch nor
the frameworks; they are imported when a monitor is created.
"""

from clusterwatch.hook.monitor import TrainingMonitor

__all__ = ["TrainingMonitor"]
