#!/usr/bin/env bash
# slurmd Prolog (slurm.conf: Prolog=/etc/slurm/clusterwatch/prolog.sh, with PrologFlags=Alloc) or
# PrologSlurmctld: registers the job with clusterwatch, which shows it as starting until its ranks
# report. Never fails the job; see clusterwatch-job.sh, installed next to this file.
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
bash "$here/clusterwatch-job.sh" begin || true
exit 0
