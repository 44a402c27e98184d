#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/*): runs as root on each node of a job
# before it starts. Grants the job's user the job's GPUs on this node's powerlib agent.
# SLURM_JOB_GPUS lists the GPU indexes allocated on this node (gres/gpu).
[ -n "$SLURM_JOB_GPUS" ] || exit 0
exec /usr/local/bin/powerlib agent grant --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" --devices "$SLURM_JOB_GPUS"
