"""``powerlib job-energy begin`` / ``end``: a Slurm job's GPU energy, from the prolog and epilog.

:mod:`powerlib.agent.job_energy` does the work; docs/cluster.md ("Job energy in Slurm") has the
slurm.conf lines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from powerlib.cli.options import Options, emit_json, settings_for
from powerlib.errors import ConfigError, PermissionDeniedError, PowerlibError

if TYPE_CHECKING:
    from powerlib.backend import Backend
    from powerlib.device import Device

__all__ = ["job_energy"]

_MAPPING_HELP = (
    "dcgm-exporter's --hpc-job-mapping-dir (e.g. /run/dcgm-job-map): the job's id is added to "
    "(begin) or taken out of (end) the file of each of its GPUs, named by the GPU's NVML index."
)


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        script = "prolog" if what == "begin" else "epilog"
        raise PermissionDeniedError(f"powerlib job-energy {what} runs as root (a Slurm {script})")


def _node_backend(opts: Options) -> Backend:
    """The node's backend with every GPU visible: indexes are then NVML's (dcgm-exporter's)."""
    from powerlib.registry import open_backend  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    settings = settings_for(opts).replace(
        cuda_visible_devices=None, hip_visible_devices=None, rocr_visible_devices=None
    )
    return open_backend(settings=settings)


def _job_gpus(backend: Backend, slurm_gpus: str | None, gpus: str | None) -> list[Device]:
    """The job's GPUs: Slurm's minor numbers (``--slurm-gpus``) or ids (``--gpus``)."""
    from powerlib.agent.node import uuids_of_minors  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.backend import match_device  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.errors import DeviceNotFoundError  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if (slurm_gpus is None) == (gpus is None):
        raise ConfigError("give the job's GPUs with --slurm-gpus or --gpus (one of them)")
    if slurm_gpus is not None:
        selectors = uuids_of_minors(
            backend, [m.strip() for m in slurm_gpus.split(",") if m.strip()]
        )
    else:
        selectors = [g.strip() for g in (gpus or "").split(",") if g.strip()]
    if not selectors:
        raise ConfigError("the job's GPU list is empty")
    devices = backend.devices()
    out: list[Device] = []
    for selector in selectors:
        dev = match_device(devices, selector)
        if dev is None:
            raise DeviceNotFoundError(f"no {backend.name} device {selector!r} on this node")
        if dev not in out:
            out.append(dev)
    return out


@click.group("job-energy")
def job_energy() -> None:
    """A Slurm job's GPU energy: begin in the prolog, end in the epilog (as root)."""


@job_energy.command()
@click.option("--job", required=True, help="The job id ($SLURM_JOB_ID).")
@click.option(
    "--slurm-gpus",
    default=None,
    metavar="MINORS",
    help="Slurm's GPU list ($SLURM_JOB_GPUS): device minor numbers (/dev/nvidiaN), each "
    "resolved to its GPU as `agent grant --slurm-gpus` does.",
)
@click.option("--gpus", default=None, metavar="IDS", help="Or: GPU UUIDs, PCI bus ids or indexes.")
@click.option("--uid", type=int, default=None, help="The job's user ($SLURM_JOB_UID), recorded.")
@click.option("--mapping-dir", type=click.Path(path_type=Path), default=None, help=_MAPPING_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@click.pass_obj
def begin(
    opts: Options,
    job: str,
    slurm_gpus: str | None,
    gpus: str | None,
    uid: int | None,
    mapping_dir: Path | None,
    as_json: bool,
) -> None:
    """Record the job's GPUs' energy counters at its start (a Slurm prolog, as root).

    \b
    powerlib job-energy begin --job "$SLURM_JOB_ID" --slurm-gpus "$SLURM_JOB_GPUS"
    """  # noqa: D301 - "\b" is click's keep-these-lines marker (a backspace), not "\\b"
    from powerlib.agent.job_energy import begin_job, check_job_id  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    _require_root("begin")
    check_job_id(job)
    backend = _node_backend(opts)
    try:
        devices = _job_gpus(backend, slurm_gpus, gpus)
        record = begin_job(
            job, devices, settings_for(opts).state_dir, uid=uid, mapping_dir=mapping_dir
        )
    except OSError as err:  # one line, never a traceback in the prolog's log
        raise PowerlibError(f"job {job}: {err}") from err
    finally:
        backend.close()
    if as_json:
        emit_json(record.to_json())
    else:
        names = ", ".join(f"{g.index} ({g.uuid})" for g in record.gpus)
        click.echo(f"job {job}: energy counters recorded on GPU {names}")


@job_energy.command()
@click.option("--job", required=True, help="The job id ($SLURM_JOB_ID).")
@click.option("--mapping-dir", type=click.Path(path_type=Path), default=None, help=_MAPPING_HELP)
@click.option(
    "--sacct",
    is_flag=True,
    help="Also write the total into the job's AdminComment in Slurm's accounting database "
    "(sacctmgr modify job, as root; slurmdbd needed), shown by `sacct -o AdminComment`: "
    "powerlib_gpu_energy_j=<J>. A failure is a warning line, never a failed epilog.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the job's energy as JSON.")
@click.pass_obj
def end(opts: Options, job: str, mapping_dir: Path | None, sacct: bool, as_json: bool) -> None:
    """The job's GPU energy since begin (a Slurm epilog, as root); its record goes.

    \b
    powerlib job-energy end --job "$SLURM_JOB_ID" --sacct
    """  # noqa: D301 - "\b" is click's keep-these-lines marker (a backspace), not "\\b"
    from powerlib.agent.job_energy import check_job_id, end_job, record_in_slurm  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.config import sacctmgr_command, scontrol_command  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    _require_root("end")
    check_job_id(job)
    backend: Backend | None
    try:
        backend = _node_backend(opts)
    except PowerlibError as err:  # the record and mapping lines still go; energy unknown
        click.echo(f"warning: job {job}: cannot read the GPUs ({err.message})", err=True)
        backend = None
    try:
        devices = None if backend is None else backend.devices()
        result = end_job(job, devices, settings_for(opts).state_dir, mapping_dir=mapping_dir)
    except OSError as err:  # one line, never a traceback in the epilog's log
        raise PowerlibError(f"job {job}: {err}") from err
    finally:
        if backend is not None:
            backend.close()
    if result is None:
        if as_json:
            emit_json({"job": job, "recorded": False, "energy_j": None})
        else:
            click.echo(f"job {job}: no job-energy record on this node (did its prolog run?)")
        return
    comment = None
    if sacct:
        try:
            comment = record_in_slurm(job, result.energy_j, scontrol_command(), sacctmgr_command())
        except PowerlibError as err:
            click.echo(f"warning: job {job}: energy not written to Slurm: {err.message}", err=True)
    if as_json:
        emit_json({**result.to_json(), "recorded": True, "admin_comment": comment})
        return
    total = "unknown" if result.energy_j is None else f"{result.energy_j:.1f} J"
    parts = ", ".join(
        f"{g.index}: {g.energy_j:.1f} J"
        if g.energy_j is not None
        else f"{g.index}: unknown ({g.unknown_reason})"
        for g in result.gpus
    )
    saved = "" if comment is None else "; in Slurm's AdminComment"
    click.echo(f"job {job}: GPU energy {total} over {result.duration_s:.1f} s ({parts}){saved}")
