"""`clusterwatch top`: the terminal view of the whole cluster, on the coordinator's Watch stream."""
