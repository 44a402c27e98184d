#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/*): runs as root on each node of a job
# before it starts. Grants the job's user the job's GPUs on this node's powerlib agent, by UUID:
# --slurm-gpus takes each number of SLURM_JOB_GPUS as the N of /dev/nvidia<N> and resolves it
# through the GPU's minor number (not the agent's PCI order). Slurm (22.05.8, measured) puts the
# GPUs' GRES indexes there, their places in gres.conf's File= list from 0: the same numbers when
# gres.conf lists /dev/nvidia0..N in order (docs/cluster.md, "Slurm's GPU numbers"). Also makes
# the user's state folder /run/powerlib/users/<uid> (0700, theirs), where their sessions journal.
# Then records the GPUs' energy counters for the epilog's `job-energy end` (and, with
# POWERLIB_DCGM_JOB_MAP_DIR set to dcgm-exporter's --hpc-job-mapping-dir, adds the job to its
# GPUs' mapping files). A failed grant fails the prolog (its exit status, as before); a failed
# energy record is only logged: a non-zero prolog drains the node for an accounting line.
[ -n "$SLURM_JOB_GPUS" ] || exit 0
POWERLIB=${POWERLIB:-/usr/local/bin/powerlib}   # where powerlib is installed
LOG=${POWERLIB_LOG:-/var/log/powerlib-restore.log}
"$POWERLIB" agent grant --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" --slurm-gpus "$SLURM_JOB_GPUS" || exit $?
set --
[ -z "$POWERLIB_DCGM_JOB_MAP_DIR" ] || set -- --mapping-dir "$POWERLIB_DCGM_JOB_MAP_DIR"
"$POWERLIB" job-energy begin --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" \
    --slurm-gpus "$SLURM_JOB_GPUS" "$@" --json >>"$LOG" 2>&1 ||
    echo "powerlib job-energy begin: job $SLURM_JOB_ID: exit $? (the job runs; no energy record)" >>"$LOG"
exit 0
