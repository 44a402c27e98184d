"""One real Slurm for the tests of this folder (tests/slurm/slurm_cluster.py), started once."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, missing_tools


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """munged, MariaDB, slurmdbd, slurmctld, slurmd and a powerlib agent, as root; all ended and
    their folder removed at the end. Skipped, with the reason, where they cannot run."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the real Slurm runs its daemons as root (Linux)")
    missing = missing_tools()
    if missing:
        pytest.skip(
            "no Slurm/munge/MariaDB here (" + ", ".join(missing) + "): Debian's slurmctld slurmd "
            "slurmdbd slurm-client munge mariadb-server-core mariadb-client-core packages "
            "(.ci/run installs them)"
        )
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
