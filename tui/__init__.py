"""`clusterwatch top`, the terminal view of the cluster (not built yet; see the open issues)."""
