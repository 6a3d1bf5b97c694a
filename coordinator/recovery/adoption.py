"""A coordinator continues a job another coordinator of its group owned (it died, left, or handed the
job on): from the job's records in etcd (coordinator/group/job_state.py), not from scratch.

- Live incidents are held again, with their ids and states; detection updates or resolves them as
  its own (an incident whose finding is already live here is not duplicated).
- Action records are kept (ListActions shows them) and taken over as after a restart
  (Recovery.take_over): their incidents are not decided again, the past hour's actions count
  against the job's cooldown and restart budget, and an action still pending, whose carrying out
  the previous owner's death or handover interrupted, is recorded failed and **not redone**: how
  much of it reached the agents is unknown, and doing it again could stop workers twice. Its
  incident, and any the previous owner was acting on, goes to a person.
- The newest complete checkpoint is known again, so a restart resumes from it.
"""

from __future__ import annotations

from clusterwatch.coordinator.detection.watchdog import Watchdog
from clusterwatch.coordinator.model.checkpoints import CheckpointTracker
from clusterwatch.coordinator.model.event_log import EventLog
from clusterwatch.coordinator.model.job_records import JobRecords
from clusterwatch.coordinator.recovery.executor import Recovery


def adopt(
    records: JobRecords,
    *,
    watchdog: Watchdog,
    recovery: Recovery,
    event_log: EventLog,
    checkpoints: CheckpointTracker,
) -> str:
    """Continue ``records.job`` from its previous owner's records; what was adopted, in a few words."""
    job = records.job
    restored = [incident for incident in records.incidents if watchdog.book.restore(incident)]
    if restored:
        event_log.save_incidents(restored)
    known = {record.id for record in event_log.actions(job=job)}
    new = [record for record in records.actions if record.id not in known]
    for record in new:
        event_log.save_action(record)
    # Those known here were taken over when this coordinator started; only the incidents adopted now
    # can have been acted on by a recovery this coordinator does not track.
    recovery.take_over(new, incidents={incident.id for incident in restored})
    checkpoint = records.checkpoint
    if checkpoint is not None and checkpoints.restore(checkpoint):
        event_log.add_checkpoint(checkpoint)
    step = f", checkpoint at step {checkpoint.step}" if checkpoint is not None else ""
    return f"{len(restored)} live incidents, {len(new)} actions{step}"
