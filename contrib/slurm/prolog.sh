#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/*): runs as root on each node of a job
# before it starts. Grants the job's user the job's GPUs on this node's powerlib agent, by UUID:
# SLURM_JOB_GPUS lists the numbers of /dev/nvidia<N> (gres.conf's File=), which need not follow
# the agent's PCI order, so --slurm-gpus resolves each through the GPU's minor number. Also makes
# the user's state folder /run/powerlib/users/<uid> (0700, theirs), where their sessions journal.
[ -n "$SLURM_JOB_GPUS" ] || exit 0
exec "${POWERLIB:-/usr/local/bin/powerlib}" agent grant --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" --slurm-gpus "$SLURM_JOB_GPUS"
