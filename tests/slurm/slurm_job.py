"""The jobs of tests/slurm: run by Slurm as the job's user, through the node's powerlib agent.

``slurm_job.py SITE hold READY RELEASE``: on the job's GPU (the first one Slurm gave it), a
ControlSession locks the clocks to 1005 MHz and sets a 250 W limit, prints a JSON line with the
GPU's UUID and energy counter, touches READY, and waits (up to 100 s) for RELEASE to appear;
then prints the counter again and closes the session (which restores the GPU).

``slurm_job.py SITE escape READY RELEASE``: the same ``hold`` in a process that left the job
(forked twice, a session of its own: Slurm's process tracking loses it, as it loses anything a
user daemonizes); it writes its pid to READY. The job's own process waits for RELEASE.

``slurm_job.py SITE touch UUID``: as this job's user, locks the clocks of the job's own GPU,
then of the GPU ``UUID`` (any GPU of the node is one UUID away); prints one JSON line
per try: the GPU and ``refused`` (``null``, or the error class and message). The first lock
is left to the agent to undo when the process exits.

SITE is the folder holding ``powerlib_checkout`` (the checkout under test, importable by uids
that cannot enter the test interpreter's folders).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1])
importlib.import_module("powerlib_checkout")  # puts the checkout's powerlib first

import powerlib  # noqa: E402
from powerlib.control import ControlSession  # noqa: E402
from powerlib.errors import PowerlibError  # noqa: E402


def job_gpu(backend: powerlib.Backend) -> powerlib.Device:
    """The job's GPU. Plain ``POWERLIB_BACKEND=agent`` lists every GPU of the node in the
    agent's order (``agent:nvidia`` would list what CUDA_VISIBLE_DEVICES shows); without a
    device cgroup, Slurm's CUDA_VISIBLE_DEVICES holds the GPU's index on the node."""
    return backend.devices()[int(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0])]


def hold(ready: Path, release: Path, *, pid_file: bool = False) -> None:
    backend = powerlib.open_backend()
    dev = job_gpu(backend)
    start_j = dev.read_state().energy_j
    session = ControlSession(backend).start()
    session.lock_sm_clocks(dev, 1005)
    session.set_power_limit(dev, 250.0)
    print(json.dumps({"uuid": dev.device_id, "energy_start_j": start_j}), flush=True)
    ready.write_text(str(os.getpid()) if pid_file else "")
    deadline = time.monotonic() + 100
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    end_j = dev.read_state().energy_j
    session.close()
    print(json.dumps({"uuid": dev.device_id, "energy_end_j": end_j}), flush=True)


def escape(ready: Path, release: Path) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            hold(ready, release, pid_file=True)
        os._exit(0)
    os.wait()
    deadline = time.monotonic() + 100
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _try_lock(backend: powerlib.Backend, uuid: str) -> None:
    try:
        dev = next(d for d in backend.devices() if d.device_id == uuid)
        dev.lock_sm_clocks(1005)
    except PowerlibError as err:
        refused: dict[str, str | None] = {"refused": type(err).__name__, "message": err.message}
    else:
        refused = {"refused": None}
    print(json.dumps({"uuid": uuid, **refused}), flush=True)


def touch(uuid: str) -> None:
    own = powerlib.open_backend()
    _try_lock(own, job_gpu(own).device_id)
    _try_lock(powerlib.open_backend(), uuid)


if __name__ == "__main__":
    if sys.argv[2] == "hold":
        hold(Path(sys.argv[3]), Path(sys.argv[4]))
    elif sys.argv[2] == "escape":
        escape(Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        touch(sys.argv[3])
