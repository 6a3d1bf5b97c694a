"""What the TUI knows: the newest snapshot, the reports before it, history and incidents.

`TopState.apply` is the only writer and runs once per update; it does the
work every view needs (history, the previous report of each node for rates)
and leaves the rest to the views, which build rows only when shown.
"""

from __future__ import annotations

import statistics

from clusterwatch.tui.feed import Delivery, Disconnected, Update
from clusterwatch.tui.history import History
from clusterwatch.v1 import cluster_pb2, node_pb2

HISTORY_POINTS = 300
"""Five minutes of 1 Hz updates."""


class TopState:
    def __init__(self, history_points: int = HISTORY_POINTS) -> None:
        self.snapshot = cluster_pb2.ClusterSnapshot()
        self.connected = False
        self.disconnected: Disconnected | None = None
        self.node_utilization = History(history_points)
        """Mean GPU utilisation (0-1) of each node, by node id."""
        self.job_step_time = History(history_points)
        """Step time (s) of each job's slowest rank, by job name."""
        self._resolved: dict[str, cluster_pb2.Incident] = {}
        self.previous_reports: dict[str, node_pb2.NodeReport] = {}
        """Each node's report before its newest one (a different sequence): rates come from the pair."""
        self._newest_reports: dict[str, node_pb2.NodeReport] = {}

    def apply(self, delivery: Delivery) -> None:
        if isinstance(delivery, Disconnected):
            self.connected = False
            self.disconnected = delivery
            return
        self._apply_update(delivery)

    def _apply_update(self, update: Update) -> None:
        self.connected = True
        self.disconnected = None
        self.snapshot = snapshot = update.snapshot
        if update.incidents is not None:
            self._resolved = {
                i.id: i for i in update.incidents if i.state == cluster_pb2.INCIDENT_STATE_RESOLVED
            }
        for node in snapshot.nodes:
            if not node.HasField("report"):
                continue
            report = node.report
            newest = self._newest_reports.get(node.node_id)
            if newest is None or newest.sequence != report.sequence:
                if newest is not None:
                    self.previous_reports[node.node_id] = newest
                self._newest_reports[node.node_id] = report
                utilizations = [g.utilization_ratio for g in report.gpus if g.HasField("utilization_ratio")]
                if utilizations:
                    self.node_utilization.record(node.node_id, statistics.fmean(utilizations))
        for job in snapshot.jobs:
            if job.HasField("step_rate") and job.step_rate > 0:
                self.job_step_time.record(job.job, 1.0 / job.step_rate)
        node_ids = {n.node_id for n in snapshot.nodes}
        for gone in self._newest_reports.keys() - node_ids:
            del self._newest_reports[gone]
            self.previous_reports.pop(gone, None)
        self.node_utilization.keep_only(node_ids)
        self.job_step_time.keep_only({j.job for j in snapshot.jobs})

    def incidents(self) -> list[cluster_pb2.Incident]:
        """Live incidents (from the newest snapshot) and recent resolved ones, oldest first."""
        live = {i.id: i for i in self.snapshot.incidents}
        merged = [i for i in self._resolved.values() if i.id not in live] + list(live.values())
        return sorted(merged, key=lambda i: i.opened_unix_seconds)

    def job(self, name: str) -> cluster_pb2.JobStatus | None:
        return next((j for j in self.snapshot.jobs if j.job == name), None)

    def rank(self, key: str) -> tuple[str, cluster_pb2.RankStatus | None]:
        """The job and the rank of a Job / Ranks row key (``JOB/RANK``); None when it is gone."""
        job_name, _, number = key.rpartition("/")
        job = self.job(job_name)
        ranks = job.ranks if job is not None else ()
        return job_name, next((r for r in ranks if str(r.identity.rank) == number), None)

    def node(self, node_id: str) -> cluster_pb2.NodeStatus | None:
        return next((n for n in self.snapshot.nodes if n.node_id == node_id), None)
