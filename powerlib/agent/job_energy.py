"""Job energy for Slurm: each job's GPU energy from its GPUs' own counters, by UUID.

The prolog (``powerlib job-energy begin``, as root) reads each of the job's GPUs' energy
counters and keeps them in a record of root's, ``<state>/jobs/<job>.json`` (0600, in a 0700
folder; ``<state>`` is ``/run/powerlib`` on a node); the epilog (``powerlib job-energy end``)
reads them again and reports the difference per GPU and in total. A GPU's counter counts the
whole GPU: on a GPU that several jobs share (shards, MPS), each job's figure is the GPU's energy
during that job, so the sharers' figures overlap. A GPU that vanished, a counter that went back
(driver reloaded) or a reboot in between makes that GPU's energy unknown (``None``), never a
guess; the total is then unknown too.

Both also keep dcgm-exporter's job-mapping files (``--hpc-job-mapping-dir``) when given their
folder: one file per GPU named by its NVML index (dcgm-exporter's GPU id), one job id per line,
several jobs on a shared GPU; dcgm-exporter then labels each GPU's series with its jobs.

Everything root touches here is opened through folder descriptors without following links and
checked with :func:`~powerlib.control.trust.check_trusted` (root's, writable by no one else);
each file is replaced whole through a temporary name and a rename in the same folder, so a
reader sees the old content or the new, never half (docs/cluster.md, "Job energy in Slurm").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import stat
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.agent.node import open_root_dir
from powerlib.control.trust import check_trusted, create_new, describe_owner, finite_number, is_int
from powerlib.device import Device
from powerlib.errors import ConfigError, PowerlibError, UntrustedStateError
from powerlib.inputs import show_path

__all__ = [
    "ENERGY_KEY",
    "GpuEnergy",
    "GpuStart",
    "JobEnergy",
    "JobRecord",
    "begin_job",
    "check_job_id",
    "end_job",
    "merge_admin_comment",
    "parse_admin_comment",
    "record_in_slurm",
]

ENERGY_KEY = "powerlib_gpu_energy_j"
"""The key ``end --sacct`` keeps in a job's AdminComment: ``powerlib_gpu_energy_j=12345.6``."""

# Slurm's job ids are numbers (SLURM_JOB_ID, an array task's and a het component's included);
# 123_4 (array) and 123+1 (het) are their display forms. Never a '/', '.' or newline.
_JOB = re.compile(r"[0-9]{1,20}(?:[_+][0-9]{1,10})?")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_MAX_RECORD_BYTES = 1 << 20
_MAX_MAPPING_BYTES = 1 << 16
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_ROOT = frozenset({0})


@dataclass(frozen=True, slots=True)
class GpuStart:
    """One GPU at the job's start: its UUID, NVML index and counter (``None``: none)."""

    uuid: str
    index: int
    energy_j: float | None


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What ``begin`` keeps for ``end``: the job, its user, when it began and its GPUs."""

    job: str
    uid: int | None
    started_s: float
    started_monotonic_s: float
    boot_id: str | None
    gpus: tuple[GpuStart, ...]

    def to_json(self) -> dict[str, Any]:
        """The record as its file holds it."""
        return {
            "job": self.job,
            "uid": self.uid,
            "started_s": self.started_s,
            "started_monotonic_s": self.started_monotonic_s,
            "boot_id": self.boot_id,
            "gpus": [{"uuid": g.uuid, "index": g.index, "energy_j": g.energy_j} for g in self.gpus],
        }


@dataclass(frozen=True, slots=True)
class GpuEnergy:
    """One GPU's energy over the job, or ``None`` and why not."""

    uuid: str
    index: int
    energy_j: float | None
    unknown_reason: str | None = None


@dataclass(frozen=True, slots=True)
class JobEnergy:
    """A job's GPU energy on this node: per GPU and in total (``None`` if any GPU is unknown)."""

    job: str
    uid: int | None
    gpus: tuple[GpuEnergy, ...]
    duration_s: float

    @property
    def energy_j(self) -> float | None:
        """The GPUs' total, ``None`` when any GPU's energy is unknown."""
        values = [g.energy_j for g in self.gpus]
        if any(v is None for v in values):
            return None
        return sum(v for v in values if v is not None)

    def to_json(self) -> dict[str, Any]:
        """``end --json``: job, uid, gpus [{uuid, index, energy_j}], energy_j, duration_s."""
        return {
            "job": self.job,
            "uid": self.uid,
            "gpus": [
                {"uuid": g.uuid, "index": g.index, "energy_j": g.energy_j}
                | ({"unknown_reason": g.unknown_reason} if g.unknown_reason else {})
                for g in self.gpus
            ],
            "energy_j": self.energy_j,
            "duration_s": self.duration_s,
        }


def check_job_id(job: str) -> str:
    """``job`` if it is a Slurm job id (``123``, ``123_4``, ``123+1``), else a ConfigError."""
    if not _JOB.fullmatch(job):
        raise ConfigError(f"job id {job!r} is not a Slurm job id (digits; 123_4 or 123+1)")
    return job


def _boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _energy_j(dev: Device) -> float | None:
    """The GPU's energy counter in joules (the backend converts), ``None`` without one."""
    if not dev.info.capabilities.has_energy_counter:
        return None
    value = dev.read_state().energy_j
    return value if value is not None and math.isfinite(value) else None


# -- folders and files of root's, through descriptors --------------------------------------------


@contextlib.contextmanager
def _jobs_dir(state_dir: Path, *, create: bool) -> Iterator[int | None]:
    """``<state>/jobs`` (root 0700) as a descriptor; ``None`` when absent and not ``create``."""
    state = Path(state_dir)
    if create:
        state.parent.mkdir(parents=True, exist_ok=True)
    try:
        state_fd = open_root_dir(state, None, state, "state folder", 0o755 if create else None)
    except FileNotFoundError:
        yield None
        return
    try:
        mode = 0o700 if create else None
        fd = open_root_dir("jobs", state_fd, state / "jobs", "job-energy folder", mode)
    except FileNotFoundError:
        fd = None
    finally:
        os.close(state_fd)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _read_file(dir_fd: int, name: str, path: Path, what: str, limit: int) -> bytes | None:
    """A regular file of root's in ``dir_fd``, read whole (``None``: there is none)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        st = os.lstat(name, dir_fd=dir_fd)
        check_trusted(path, st, what=what, directory=False, trusted_uids=_ROOT)
        raise  # pragma: no cover - a link is refused above
    try:
        check_trusted(path, os.fstat(fd), what=what, directory=False, trusted_uids=_ROOT)
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UntrustedStateError(f"refusing the {what} {show_path(path)}: over {limit} bytes")
    return data


def _check_replaceable(dir_fd: int, name: str, path: Path, what: str) -> None:
    """Refuse to replace anything but a regular file of root's (a planted link, a folder)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    check_trusted(path, st, what=what, directory=False, trusted_uids=_ROOT)


def _write_file(dir_fd: int, name: str, path: Path, what: str, data: bytes, mode: int) -> None:
    """Replace ``name`` in ``dir_fd`` with ``data`` (``mode``): a temporary file, then a rename.

    The temporary name starts with a dot, which dcgm-exporter skips (it reads integer names).
    """
    _check_replaceable(dir_fd, name, path, what)
    tmp = f".{name}.tmp"
    fd = create_new(tmp, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _remove_file(dir_fd: int, name: str, path: Path, what: str) -> bool:
    """Unlink ``name`` (a regular file of root's) from ``dir_fd``; False if there was none."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    check_trusted(path, st, what=what, directory=False, trusted_uids=_ROOT)
    os.unlink(name, dir_fd=dir_fd)
    return True


@contextlib.contextmanager
def _mapping_dir(folder: Path) -> Iterator[int]:
    """dcgm-exporter's job-mapping folder (root 0755, made if absent), locked (``flock``).

    Its parent must be root's and writable by no one else unless sticky (``/run``, ``/tmp``):
    otherwise someone else could swap the folder for theirs between two epilogs. A link, or a
    folder that is not root's, is refused. Held locked while the files are rewritten, so two
    jobs' prologs and epilogs on one GPU never lose each other's lines.
    """
    folder = Path(folder)
    try:
        parent_fd = os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise ConfigError(
            f"the job-mapping folder {show_path(folder)}: its parent cannot be opened "
            f"({err.strerror})"
        ) from None
    try:
        st = os.fstat(parent_fd)
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
        if st.st_uid != 0 or writable:
            raise UntrustedStateError(
                f"refusing the job-mapping folder {show_path(folder)}: its parent (owner "
                f"{describe_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}) must be "
                "root's and writable by no one else unless sticky"
            )
        fd = open_root_dir(folder.name, parent_fd, folder, "job-mapping folder", 0o755)
    finally:
        os.close(parent_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _update_mapping(dir_fd: int, folder: Path, index: int, job: str, *, add: bool) -> None:
    """Add ``job``'s line to (or take it out of) GPU ``index``'s file; an empty file goes."""
    name = str(index)
    path = folder / name
    what = "job-mapping file"
    data = _read_file(dir_fd, name, path, what, _MAX_MAPPING_BYTES)
    lines = [] if data is None else data.decode("utf-8", "replace").splitlines()
    kept = [line for line in lines if line.strip() and line.strip() != job]
    if add:
        kept.append(job)
    if kept:
        if kept != lines:
            _write_file(dir_fd, name, path, what, "".join(f"{x}\n" for x in kept).encode(), 0o644)
    elif data is not None:
        _remove_file(dir_fd, name, path, what)


# -- the record ------------------------------------------------------------------------------------


def _parse_record(raw: bytes, job: str, path: Path) -> JobRecord:
    """A record read back; anything malformed is refused in one line (root wrote it)."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("job") != job:
            raise ValueError("not this job's record")
        uid = data.get("uid")
        if uid is not None and not is_int(uid):
            raise TypeError("uid is not an integer")
        gpus = []
        for g in data["gpus"]:
            if not isinstance(g["uuid"], str) or not is_int(g["index"]):
                raise TypeError("a GPU's uuid or index is malformed")
            start = None if g["energy_j"] is None else finite_number(g["energy_j"], "energy_j")
            gpus.append(GpuStart(uuid=g["uuid"], index=int(g["index"]), energy_j=start))
        boot = data.get("boot_id")
        return JobRecord(
            job=job,
            uid=uid,
            started_s=finite_number(data["started_s"], "started_s"),
            started_monotonic_s=finite_number(data["started_monotonic_s"], "started_monotonic_s"),
            boot_id=boot if isinstance(boot, str) else None,
            gpus=tuple(gpus),
        )
    except (ValueError, TypeError, KeyError) as err:
        raise UntrustedStateError(
            f"refusing the job-energy record {show_path(path)}: malformed ({err})"
        ) from None


def begin_job(
    job: str,
    gpus: Sequence[Device],
    state_dir: Path,
    *,
    uid: int | None = None,
    mapping_dir: Path | None = None,
) -> JobRecord:
    """Record the start of ``job`` on ``gpus`` (a prolog, as root); add its mapping lines.

    A record the job already has (a requeued job keeps its id) is replaced: the energy counts
    from this start.

    Raises:
        ConfigError: A bad job id, or no GPU.
        UntrustedStateError: A folder or file on the way is a link, not root's, or writable
            by others; nothing is written then.
    """
    check_job_id(job)
    if not gpus:
        raise ConfigError(f"job {job}: no GPU to record")
    with contextlib.ExitStack() as stack:
        jobs_fd = stack.enter_context(_jobs_dir(state_dir, create=True))
        assert jobs_fd is not None
        map_fd = None if mapping_dir is None else stack.enter_context(_mapping_dir(mapping_dir))
        name = f"{job}.json"
        path = Path(state_dir) / "jobs" / name
        _check_replaceable(jobs_fd, name, path, "job-energy record")
        record = JobRecord(
            job=job,
            uid=uid,
            started_s=time.time(),
            started_monotonic_s=time.monotonic(),
            boot_id=_boot_id(),
            gpus=tuple(GpuStart(d.device_id, d.index, _energy_j(d)) for d in gpus),
        )
        body = json.dumps(record.to_json()).encode()
        _write_file(jobs_fd, name, path, "job-energy record", body, 0o600)
        if map_fd is not None and mapping_dir is not None:
            for gpu in record.gpus:
                _update_mapping(map_fd, Path(mapping_dir), gpu.index, job, add=True)
    return record


def _gpu_energy(start: GpuStart, devices: Sequence[Device] | None, rebooted: bool) -> GpuEnergy:
    """One GPU's energy since ``start``, or unknown and why (never negative, never invented)."""

    def unknown(reason: str) -> GpuEnergy:
        return GpuEnergy(start.uuid, start.index, None, reason)

    if rebooted:
        return unknown("the node rebooted since the job began")
    if devices is None:
        return unknown("the GPUs could not be read")
    folded = start.uuid.lower()
    dev = next((d for d in devices if d.device_id.lower() == folded), None)
    if dev is None:
        return unknown("the GPU is gone")
    now = _energy_j(dev)
    if start.energy_j is None or now is None:
        return GpuEnergy(start.uuid, dev.index, None, "the GPU has no energy counter")
    if now < start.energy_j:
        return GpuEnergy(start.uuid, dev.index, None, "its counter went back (driver reloaded?)")
    return GpuEnergy(start.uuid, dev.index, now - start.energy_j)


def end_job(
    job: str,
    devices: Sequence[Device] | None,
    state_dir: Path,
    *,
    mapping_dir: Path | None = None,
) -> JobEnergy | None:
    """The energy of ``job``'s GPUs since ``begin`` (an epilog, as root); ``None``: no record.

    Reads the counters, takes the job's lines out of the mapping files (those of the GPUs its
    record names), then deletes the record. ``devices``: this node's GPUs, ``None`` when they
    could not be read (every GPU is then unknown; the record and lines still go).

    Raises:
        ConfigError: A bad job id.
        UntrustedStateError: A folder or file on the way is a link, not root's, writable by
            others, or a malformed record; nothing is removed then.
    """
    check_job_id(job)
    with contextlib.ExitStack() as stack:
        jobs_fd = stack.enter_context(_jobs_dir(state_dir, create=False))
        if jobs_fd is None:
            return None
        name = f"{job}.json"
        path = Path(state_dir) / "jobs" / name
        raw = _read_file(jobs_fd, name, path, "job-energy record", _MAX_RECORD_BYTES)
        if raw is None:
            return None
        record = _parse_record(raw, job, path)
        boot = _boot_id()
        rebooted = record.boot_id is not None and boot is not None and boot != record.boot_id
        gpus = tuple(_gpu_energy(g, devices, rebooted) for g in record.gpus)
        if rebooted:
            duration_s = max(0.0, time.time() - record.started_s)
        else:
            duration_s = max(0.0, time.monotonic() - record.started_monotonic_s)
        if mapping_dir is not None:
            map_fd = stack.enter_context(_mapping_dir(mapping_dir))
            for gpu in record.gpus:
                _update_mapping(map_fd, Path(mapping_dir), gpu.index, job, add=False)
        _remove_file(jobs_fd, name, path, "job-energy record")
    return JobEnergy(job=job, uid=record.uid, gpus=gpus, duration_s=duration_s)


# -- Slurm's AdminComment ----------------------------------------------------------------------------


def parse_admin_comment(show_job: str) -> str:
    """The AdminComment in ``scontrol show job`` output ("" when it has none).

    Slurm prints it on a line of its own, ``   AdminComment=<text> `` (the trailing space is
    Slurm's), and only when it is set.
    """
    for line in show_job.splitlines():
        text = line.lstrip()
        if text.startswith("AdminComment="):
            value = text[len("AdminComment=") :]
            return value[:-1] if value.endswith(" ") else value
    return ""


def merge_admin_comment(existing: str, energy_j: float | None) -> str:
    """``existing`` with its ``powerlib_gpu_energy_j=`` key set to ``energy_j``; all else kept.

    The key is appended after a space (or replaces an earlier one in place of it); ``unknown``
    when a GPU's energy is unknown.
    """
    value = "unknown" if energy_j is None else f"{energy_j:.1f}"
    kept = re.sub(rf"(^|\s+){re.escape(ENERGY_KEY)}=\S*", "", existing).strip()
    return f"{kept} {ENERGY_KEY}={value}".strip()


def _run_slurm(argv: list[str], timeout_s: float) -> str:
    """Run one Slurm command; its stdout, or a PowerlibError naming what failed."""
    what = " ".join(argv[:3])
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise PowerlibError(
            f"{argv[0]}: not found (set POWERLIB_SCONTROL and POWERLIB_SACCTMGR)"
        ) from None
    except subprocess.TimeoutExpired:
        raise PowerlibError(f"{what}: no answer in {timeout_s:g} s") from None
    except OSError as err:
        raise PowerlibError(f"{what}: {err.strerror}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise PowerlibError(f"{what}: {said[:300]}")
    return done.stdout


def record_in_slurm(
    job: str, energy_j: float | None, scontrol: str, sacctmgr: str, *, timeout_s: float = 30.0
) -> str:
    """Write the job's GPU energy into its AdminComment (root: a Slurm administrator).

    ``sacct -o AdminComment`` shows it, from slurmdbd; a user cannot set it (unlike Comment).
    At epilog time the job is completing, which slurmctld counts as finished: ``scontrol
    update`` refuses it ("Job has already finished", measured on Slurm 22.05.8), so the value
    goes into the accounting database with ``sacctmgr modify job``, which changes a finished
    job's AdminComment. What the comment already holds (``scontrol show job`` still shows a
    completing job) is kept: only the ``powerlib_gpu_energy_j=`` key changes. The figure is this
    node's GPUs': on a job of several nodes each node's epilog rewrites the key, so the last
    one's stands (docs/cluster.md, "Job energy in Slurm").

    Returns:
        The AdminComment written.

    Raises:
        PowerlibError: scontrol or sacctmgr is missing, failed, did not answer, or the database
            holds no such job (one line).
    """
    check_job_id(job)
    shown = _run_slurm([scontrol, "show", "job", job], timeout_s)
    comment = merge_admin_comment(parse_admin_comment(shown), energy_j)
    said = _run_slurm(
        [
            sacctmgr,
            "-i",
            "modify",
            "job",
            "where",
            f"jobid={job}",
            "set",
            f"AdminComment={comment}",
        ],
        timeout_s,
    )
    if "Modified jobs" not in said:  # "Nothing modified": slurmdbd holds no such job (yet)
        raise PowerlibError(f"sacctmgr modify job {job}: {said.strip()[:200] or 'no answer'}")
    return comment
