"""One collector per file (gpu, host, network, infiniband), each filling its part of a NodeReport."""
