#!/bin/sh
# Slurm Epilog: runs as root on each node after the job ends. The agent has already restored the
# job's GPUs (each lease ends with its client's connection or process); this removes the grant.
exec /usr/local/bin/powerlib agent revoke --job "$SLURM_JOB_ID"
