"""clusterwatch: watch multi-node PyTorch training and keep it running."""

__version__ = "0.1.0"
