"""``clusterwatch simulate``: synthetic training jobs with injected faults and their ground truth.

One module per job: ``scenario`` reads and checks scenario files, ``noise``
draws the seeded per-rank noise, ``ranks`` is the synchronous job model
(steps, collectives, heartbeats, the faults' effects on them), ``nodes`` makes
up the node telemetry (GPUs, host, NICs, InfiniBand), ``streams`` speaks the
agent protocol to a coordinator, ``truth`` is the ground-truth record, and
``runner`` drives all of it in real time.
"""
