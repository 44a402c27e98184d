#!/bin/sh
# Slurm Epilog: runs as root on each node after the job ends; a non-zero exit drains the node.
# 0. The job's GPU energy since the prolog's record, from the GPUs' counters: logged as JSON and
#    written into the job's AdminComment (`sacct -o AdminComment`: powerlib_gpu_energy_j=<J>);
#    the job leaves dcgm-exporter's mapping files (POWERLIB_DCGM_JOB_MAP_DIR). Accounting never
#    fails the epilog: what goes wrong is a line in the log.
# 1. What the job's own sessions left in the user's state folders is reset to the driver
#    defaults, on the job's GPUs only (from its grant), under root's device lock; a GPU still
#    leased is left to its lease. What a user planted is skipped and logged, never a failure.
# 2. The grant goes, and the agent ends and restores every lease it admitted (a process the user
#    started outside the job included) before revoke returns.
# 3. Root's own state: journals a dead root session left.
[ -n "$SLURM_JOB_GPUS" ] || exit 0
POWERLIB=${POWERLIB:-/usr/local/bin/powerlib}   # where powerlib is installed
LOG=${POWERLIB_LOG:-/var/log/powerlib-restore.log}
rc=0
set --
[ -z "$POWERLIB_DCGM_JOB_MAP_DIR" ] || set -- --mapping-dir "$POWERLIB_DCGM_JOB_MAP_DIR"
"$POWERLIB" job-energy end --job "$SLURM_JOB_ID" --sacct "$@" --json >>"$LOG" 2>&1 ||
    echo "powerlib job-energy end: job $SLURM_JOB_ID: exit $? (not failing the epilog)" >>"$LOG"
"$POWERLIB" restore --for-user "$SLURM_JOB_UID" --job "$SLURM_JOB_ID" --json >>"$LOG" || rc=$?
"$POWERLIB" agent revoke --job "$SLURM_JOB_ID" >>"$LOG" 2>&1 || rc=$?
"$POWERLIB" restore --json >>"$LOG" || rc=$?
exit "$rc"
