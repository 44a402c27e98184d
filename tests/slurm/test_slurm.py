"""powerlib on a real Slurm (22.05): prolog, epilog and agent around jobs of normal users.

One node (tests/slurm/slurm_cluster.py) with three simulated GPUs served by a root
``powerlib agent``; slurm.conf's Prolog and Epilog run contrib/slurm's scripts. Jobs are
submitted with sbatch as ``nobody`` (and a second user, ``_apt``, Debian's other account in
nogroup, the agent socket's group) and use their GPU through the agent
(``POWERLIB_BACKEND=agent``), as training would. The ground truth of every GPU is read by this
test, as root, from the agent's state folder.

The energy figure in sacct is compared with the GPU's counter over the same interval, read
independently: a thread here samples the job's GPU's counter every 20 ms, and the figure must
equal the sampled counter's increase between the prolog's read and the epilog's (their times are
what ``job-energy end`` reports: ``started_s`` at begin, plus ``duration_s``) within 2 %.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from slurm_cluster import GPUS, NOBODY, SlurmCluster, wait_for

from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings

JOB = Path(__file__).with_name("slurm_job.py")
DEFAULT = [(None, 400.0)] * GPUS  # A100 40GB simulated: unlocked, 400 W
HELD = ((1005.0, 1005.0), 250.0)  # what a holding job sets on its GPU
ENERGY = re.compile(r"powerlib_gpu_energy_j=([0-9.]+)")

pytestmark = pytest.mark.slow  # a real cluster: about 25 s in all, its start included


def _backend(slurm: SlurmCluster) -> SimulatedBackend:
    return SimulatedBackend(
        Settings(
            backend="simulated", sim_gpus=GPUS, state_dir=slurm.state, sim_energy_period_s=0.01
        )
    )


def truth(slurm: SlurmCluster) -> list[tuple[Any, float | None]]:
    """(locked clocks, power limit) of every GPU, read from the agent's state folder."""
    backend = _backend(slurm)
    try:
        return [
            (s.locked_sm_freqs_mhz, s.power_limit_w)
            for s in (d.read_state() for d in backend.devices())
        ]
    finally:
        backend.close()


class Sampler:
    """Every GPU's energy counter, read every 20 ms in a thread: ``(time.time(), [J, ...])``."""

    def __init__(self, slurm: SlurmCluster) -> None:
        self.backend = _backend(slurm)
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.time()
            energy = [float(d.read_state().energy_j or 0.0) for d in self.backend.devices()]
            t1 = time.time()
            self.samples.append(((t0 + t1) / 2, energy))
            self._stop.wait(0.02)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.backend.close()

    def at(self, t_s: float, gpu: int) -> float:
        """GPU ``gpu``'s counter at ``t_s``, linear between the samples around it."""
        for (ta, ea), (tb, eb) in zip(self.samples, self.samples[1:], strict=False):
            if ta <= t_s <= tb:
                return ea[gpu] + (eb[gpu] - ea[gpu]) * (t_s - ta) / (tb - ta)
        raise AssertionError(f"{t_s} is outside the samples")


class Job:
    """A job that holds its GPU through the agent until released (slurm_job.py)."""

    def __init__(self, slurm: SlurmCluster, uid: int, mode: str = "hold", *args: str) -> None:
        self.slurm = slurm
        self.name = f"{mode}-{time.monotonic_ns()}"
        self.ready = slurm.work / f"{self.name}.ready"
        self.release = slurm.work / f"{self.name}.release"
        self.out = slurm.work / f"{self.name}.out"
        tail = args or (str(self.ready), str(self.release))
        script = f"#!/bin/sh\nexec {slurm.job_python} {JOB} {slurm.site} {mode} {' '.join(tail)}\n"
        env = {"POWERLIB_BACKEND": "agent", "POWERLIB_AGENT_SOCKET": str(slurm.sock)}
        self.id = slurm.submit(uid, script, "--gres=gpu:1", f"--output={self.out}", env=env)

    def wait_ready(self) -> None:
        wait_for(self.ready.exists, f"job {self.id} to hold its GPU ({self.output()})", 60)

    def output(self) -> list[dict[str, Any]]:
        text = self.out.read_text() if self.out.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def wait_gone(self) -> None:
        """Until the job left the queue and its epilog ended."""
        self.slurm.wait_gone(self.id)
        wait_for(lambda: "epilog rc" in self.slurm.script_times(self.id), "the epilog", 30)
        assert self.slurm.script_times(self.id)["epilog rc"] == 0, self.slurm.log("powerlib.log")

    def sacct_energy_j(self) -> float:
        """The energy in the job's AdminComment, once sacct shows it (10 s at most)."""
        found: list[float] = []

        def shown() -> bool:
            rows = self.slurm.sacct(self.id, "AdminComment")
            match = ENERGY.search(rows[0][0]) if rows else None
            if match:
                found.append(float(match.group(1)))
            return bool(match)

        wait_for(shown, f"job {self.id}'s energy in sacct ({self.slurm.log('powerlib.log')})", 10)
        return found[0]


def energy_reports(slurm: SlurmCluster, job: str) -> dict[str, dict[str, Any]]:
    """The ``job-energy begin`` and ``end`` JSON documents the prolog and epilog logged."""
    text, decoder, found = slurm.log("powerlib.log"), json.JSONDecoder(), {}
    for m in re.finditer(r"^\{", text, re.MULTILINE):
        with contextlib.suppress(ValueError):
            doc, _ = decoder.raw_decode(text, m.start())
            if isinstance(doc, dict) and doc.get("job") == job and "gpus" in doc:
                found["end" if "duration_s" in doc else "begin"] = doc
    return found


@pytest.fixture
def idle(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster with every GPU at its defaults before and after the test."""
    assert truth(slurm) == DEFAULT
    yield slurm
    left = slurm.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    if left:  # a failed test's jobs: cancelled, so that the next test finds the node idle
        slurm.run(["scancel", *left])
    wait_for(lambda: slurm.run(["squeue", "-h"]).stdout.strip() == "", "an empty queue", 60)
    wait_for(lambda: truth(slurm) == DEFAULT, "every GPU at its defaults", 10)


def _index(slurm: SlurmCluster, uuid: str) -> int:
    backend = _backend(slurm)
    try:
        return next(d.index for d in backend.devices() if d.device_id == uuid)
    finally:
        backend.close()


def _second_user() -> int:
    """Another uid in nogroup (the agent socket's group): Debian's ``_apt``."""
    import pwd

    for entry in pwd.getpwall():
        if entry.pw_gid == NOBODY and entry.pw_uid not in (0, NOBODY):
            return entry.pw_uid
    pytest.skip("no second user in nogroup (Debian has _apt)")


def test_a_jobs_gpu_energy_is_in_sacct_and_its_gpu_restored(idle: SlurmCluster) -> None:
    """nobody's job locks its GPU's clocks and limit through the agent and ends; sacct's
    AdminComment holds its GPU energy within 2 % of the counter's increase over the job,
    sampled here; the GPU is back at its defaults."""
    slurm = idle
    with Sampler(slurm) as sampler:
        job = Job(slurm, NOBODY)
        job.wait_ready()
        gpu = _index(slurm, job.output()[0]["uuid"])
        assert truth(slurm)[gpu] == HELD
        time.sleep(2.0)
        job.release.touch()
        job.wait_gone()
        energy_j = job.sacct_energy_j()
    assert truth(slurm) == DEFAULT
    reports = energy_reports(slurm, job.id)
    begin_s = reports["begin"]["started_s"]
    end_s = begin_s + reports["end"]["duration_s"]
    times = slurm.script_times(job.id)
    assert times["prolog start"] < begin_s < times["prolog end"]
    assert times["epilog start"] < end_s < times["epilog end"]
    counters_j = sampler.at(end_s, gpu) - sampler.at(begin_s, gpu)
    assert energy_j == pytest.approx(counters_j, rel=0.02)
    start, end = job.output()
    assert end["energy_end_j"] - start["energy_start_j"] < energy_j  # the job's own reads: inside
    assert reports["end"]["gpus"][0]["index"] == gpu


def test_scancel_restores_the_gpu(idle: SlurmCluster) -> None:
    """A holding job cancelled by its user: the epilog runs, the GPU is back at its defaults,
    and the job's energy is in sacct all the same."""
    slurm = idle
    job = Job(slurm, NOBODY)
    job.wait_ready()
    gpu = _index(slurm, job.output()[0]["uuid"])
    assert truth(slurm)[gpu] == HELD
    slurm.run_as(NOBODY, ["scancel", job.id])
    job.wait_gone()
    assert slurm.sacct(job.id, "State")[0][0].startswith("CANCELLED")
    assert truth(slurm) == DEFAULT
    assert job.sacct_energy_j() > 0


def test_a_node_side_kill_leaves_the_restore_to_the_epilog(idle: SlurmCluster) -> None:
    """The job's GPU is held by a process that left the job (Slurm's tracking loses it), and
    the job's own process is killed with SIGKILL on the node: the job fails, the escaped
    process lives on, and the epilog (agent revoke) restores the GPU under it."""
    slurm = idle
    job = Job(slurm, NOBODY, "escape")
    job.wait_ready()
    escaped = int(job.ready.read_text())
    try:
        gpu = _index(slurm, job.output()[0]["uuid"])
        assert truth(slurm)[gpu] == HELD
        mains = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(job.release) in " ".join(p.info["cmdline"] or []) and p.pid != escaped
        ]
        assert len(mains) == 1
        mains[0].send_signal(signal.SIGKILL)
        job.wait_gone()
        assert slurm.sacct(job.id, "State")[0][0] == "FAILED"
        assert psutil.Process(escaped).is_running()  # Slurm did not end it: the epilog did
        assert truth(slurm) == DEFAULT
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(escaped, signal.SIGKILL)


def test_a_second_users_job_cannot_touch_the_first_jobs_gpu(idle: SlurmCluster) -> None:
    """While nobody's job holds its GPU, a job of a second user may lock its own GPU but is
    refused on the first job's, naming the uid; the first job's settings stand."""
    slurm = idle
    second = _second_user()
    first = Job(slurm, NOBODY)
    first.wait_ready()
    uuid = first.output()[0]["uuid"]
    gpu = _index(slurm, uuid)
    other = Job(slurm, second, "touch", uuid)
    other.wait_gone()
    own, theirs = other.output()
    assert own["uuid"] != uuid and own["refused"] is None
    assert theirs["uuid"] == uuid and theirs["refused"] == "PermissionDeniedError"
    assert f"uid {second} may not control device" in theirs["message"]
    assert truth(slurm)[gpu] == HELD
    first.release.touch()
    first.wait_gone()
    assert truth(slurm) == DEFAULT
