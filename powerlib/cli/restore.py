"""``powerlib restore``: put devices back from the journals sessions left behind.

One call to :func:`powerlib.control.restore_journals`; this module only formats its outcomes.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import click

from powerlib.cli.options import Options, emit_json, settings_for
from powerlib.config import NODE_STATE_DIR, Settings, user_state_dirs
from powerlib.control import RestoreOutcome, restore_failure, restore_for_user, restore_journals
from powerlib.errors import ConfigError, PowerlibError
from powerlib.inspection import SCHEMA_VERSION

__all__ = ["restore"]


def _trust_owner_uids(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...] | str | None
) -> tuple[int, ...]:
    """``--for-user`` / ``--trust-owner`` values (uids or user names) as uids."""
    if values is None:
        return ()
    uids = []
    for value in (values,) if isinstance(values, str) else values:
        if value.isdigit():
            uids.append(int(value))
            continue
        try:
            uids.append(pwd.getpwnam(value).pw_uid)
        except KeyError:
            raise click.BadParameter(
                f"no user is named {value!r}; give a uid or a user name"
            ) from None
    return tuple(uids)


def _still_modified(outcome: RestoreOutcome) -> dict[str, object]:
    """A failed restore step as a ``still_modified`` row (``item: unknown`` for a journal)."""
    return {
        "device_id": outcome.device_id,
        "item": "unknown" if outcome.item == "journal" else outcome.item,
        "journal": outcome.journal,
        "reason": outcome.action,
        "error_code": outcome.error_code,
    }


@click.command()
@click.option(
    "--stale",
    "mode",
    flag_value="stale",
    default=True,
    help="Restore journals whose owner process is gone (default).",
)
@click.option(
    "--all",
    "mode",
    flag_value="all",
    help="Also restore journals of running owners (for an operator clearing a node).",
)
@click.option("--dry-run", is_flag=True, help="Show what would be restored; change nothing.")
@click.option(
    "--for-user",
    "for_user",
    metavar="UID",
    default=None,
    callback=_trust_owner_uids,
    help=(
        'Act for this user (uid or name; a Slurm epilog: "$SLURM_JOB_UID"): restore what '
        "their dead sessions left on their job's devices (--job or --devices), from their state "
        "folders (/run/powerlib/users/UID, /run/user/UID/powerlib, $TMPDIR/powerlib-UID, or "
        "--user-state-dir). Each device is reset to the driver default and read back; no value "
        "from the user's files is ever written. What cannot be trusted is skipped and logged, "
        "not an error."
    ),
)
@click.option(
    "--trust-owner",
    "trusted_uids",
    metavar="UID",
    multiple=True,
    callback=_trust_owner_uids,
    hidden=True,
    help="Earlier releases' form of --for-user (one user; needs --job or --devices).",
)
@click.option(
    "--job",
    default=None,
    help="With --for-user: the job whose grant (powerlib agent grant) names the devices.",
)
@click.option(
    "--devices",
    "device_list",
    default=None,
    metavar="IDS",
    help="With --for-user: the job's devices, comma-separated UUIDs, PCI bus ids or indexes.",
)
@click.option(
    "--slurm-gpus",
    default=None,
    metavar="MINORS",
    help='With --for-user: Slurm\'s GPU list ("$SLURM_JOB_GPUS"), device minor numbers '
    "(/dev/nvidiaN), which need not follow the PCI order indexes use; each is resolved to its "
    "UUID on this node, as `powerlib agent grant --slurm-gpus` does.",
)
@click.option(
    "--user-state-dir",
    "user_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="With --for-user: a state folder of the user's to restore from instead of the default "
    "ones (repeatable; e.g. a job's own POWERLIB_STATE_DIR). Named by its real path: a "
    "symbolic link in any component of it is refused.",
)
@click.option(
    "--grants-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="With --job: where the agent's job grants live (default: grants/ in root's state "
    f"folder, POWERLIB_STATE_DIR, normally {NODE_STATE_DIR / 'grants'}).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def restore(
    opts: Options,
    mode: str,
    dry_run: bool,
    for_user: tuple[int, ...],
    trusted_uids: tuple[int, ...],
    job: str | None,
    device_list: str | None,
    slurm_gpus: str | None,
    user_dirs: tuple[Path, ...],
    grants_dir: Path | None,
    as_json: bool,
) -> None:
    """Put devices back from the journals that sessions left in the state directory.

    A session journals each device's original settings before changing it and deletes the
    journal once it has restored them; a journal left behind means its owner was killed
    (SIGKILL, OOM, crash). Run this from a Slurm epilog or a systemd unit to clean up a node.
    Each journal reopens the backend it was written with; --backend is ignored here, except
    with --for-user, which opens the node's devices with --backend (default auto).

    Only trusted state is acted on: folders and journals owned by you or root, not writable by
    group or others, real folders and regular files. Anything else is refused with one line
    naming its path, owner and mode (exit 12). After restoring, each device is read back;
    whatever is still modified is listed and the exit code is non-zero.

    With --for-user (root in an epilog), the user's state folders are read as hostile input:
    each is walked from / following no link, the folders above the user's must be root's (not
    writable by others unless sticky) and the user's folder and files exactly theirs (not
    root's), never on a FUSE mount; only the job's devices are touched, each reset to the driver default under root's own
    device lock (a device another process has leased is left to that lease), and what cannot
    be trusted is skipped and logged; the exit code is non-zero only when a job device could
    not be reset.
    """
    acting_for = (*for_user, *trusted_uids)
    if len(set(acting_for)) > 1:
        raise ConfigError("a restore acts for one user at a time: give --for-user once")
    if not acting_for and (job or device_list or slurm_gpus or user_dirs):
        raise ConfigError(
            "--job, --devices, --slurm-gpus and --user-state-dir go with --for-user UID"
        )
    settings = Settings.from_env()
    report: dict[str, object] = {
        "schema": f"powerlib.restore.v{SCHEMA_VERSION}",
        "state_dir": str(settings.state_dir),
        "mode": mode,
        "dry_run": dry_run,
        "trusted_uids": sorted({os.geteuid(), 0, *acting_for}),
    }
    try:
        if acting_for:
            uid = acting_for[0]
            if slurm_gpus is not None:
                device_list = _slurm_devices(opts, slurm_gpus, job, device_list)
            devices, folders = _user_scope(uid, settings, job, device_list, user_dirs, grants_dir)
            report.update(for_user=uid, devices=devices, user_state_dirs=[str(f) for f in folders])
            outcomes = restore_for_user(
                settings_for(opts),
                uid,
                devices,
                user_dirs=folders,
                include_live=mode == "all",
                dry_run=dry_run,
            )
        else:
            outcomes = restore_journals(settings, include_live=mode == "all", dry_run=dry_run)
    except PowerlibError as err:  # the state folder itself: nothing was done
        if as_json:
            emit_json(_refused(report, err))
        raise
    failure = restore_failure(outcomes)
    if as_json:
        emit_json(_restored(report, outcomes, failure))
    else:
        _echo_outcomes(outcomes, settings.state_dir)
    if failure is not None:
        raise failure


def _refused(report: dict[str, object], err: PowerlibError) -> dict[str, object]:
    """``report`` for a restore refused before anything was done (the state folder)."""
    report.update(
        ok=False,
        error=str(err),
        exit_code=err.exit_code,
        outcomes=[],
        still_modified=[
            {
                "device_id": "?",
                "item": "unknown",
                "journal": None,
                "reason": str(err),
                "error_code": err.exit_code,
            }
        ],
    )
    return report


def _restored(
    report: dict[str, object], outcomes: list[RestoreOutcome], failure: PowerlibError | None
) -> dict[str, object]:
    """``report`` with the restore's outcomes and what is still modified."""
    report.update(
        ok=failure is None,
        error=None if failure is None else str(failure),
        exit_code=0 if failure is None else failure.exit_code,
        outcomes=[o.to_json() for o in outcomes],
        still_modified=[_still_modified(o) for o in outcomes if not o.ok],
    )
    return report


def _echo_outcomes(outcomes: list[RestoreOutcome], state_dir: Path) -> None:
    """One line per outcome: red when the device is still modified, yellow when skipped."""
    if not outcomes:
        click.echo(f"nothing to restore in {state_dir}")
        return
    for o in outcomes:
        owner = f" (journal of pid {o.owner_pid})" if o.owner_pid is not None else ""
        line = f"{o.device_id} {o.item}: {o.action}{owner}"
        color = "red" if not o.ok else ("yellow" if o.skipped else None)
        click.echo(click.style(line, fg=color))


def _user_scope(
    uid: int,
    settings: Settings,
    job: str | None,
    device_list: str | None,
    user_dirs: tuple[Path, ...],
    grants_dir: Path | None,
) -> tuple[list[str], list[Path]]:
    """A restore for ``uid``: the job's devices and the state folders to restore from."""
    grants = grants_dir if grants_dir is not None else settings.state_dir / "grants"
    devices = _job_devices(uid, job, device_list, grants)
    # made absolute, never resolved: the restore walks the path itself, following no link
    folders = [Path.cwd() / f for f in user_dirs] or list(user_state_dirs(uid, settings.state_dir))
    return devices, folders


def _slurm_devices(opts: Options, slurm_gpus: str, job: str | None, device_list: str | None) -> str:
    """``--slurm-gpus``: Slurm's minor numbers as the UUIDs of this node's devices (``--devices``).

    ``$SLURM_JOB_GPUS`` lists ``/dev/nvidia<N>`` numbers (gres.conf's ``File=``), which need not
    follow the PCI order that indexes follow: read as indexes they could name another job's GPU.

    Raises:
        ConfigError: Given with --job or --devices, or a number is not a minor number.
        DeviceNotFoundError: No device of this node has that minor number.
    """
    from powerlib.agent.node import uuids_of_minors  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.registry import open_backend  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if job is not None or device_list is not None:
        raise ConfigError("give the job's devices once: --job, --devices or --slurm-gpus")
    minors = [m.strip() for m in slurm_gpus.split(",") if m.strip()]
    if not minors:
        raise ConfigError("--slurm-gpus names no device")
    settings = settings_for(opts).replace(  # the node's devices, as restore_for_user sees them
        cuda_visible_devices=None, hip_visible_devices=None, rocr_visible_devices=None
    )
    backend = open_backend(settings=settings)
    try:
        return ",".join(uuids_of_minors(backend, minors))
    finally:
        backend.close()


def _job_devices(uid: int, job: str | None, device_list: str | None, grants_dir: Path) -> list[str]:
    """The job's devices, from ``--devices`` or the job's grant (whose uid must be ``uid``)."""
    if (job is None) == (device_list is None):
        raise ConfigError(
            "a restore for another user acts only on that user's job's devices: give --job JOB "
            "(its grant names them), --devices IDS or --slurm-gpus MINORS"
        )
    if device_list is not None:
        names = [d.strip() for d in device_list.split(",") if d.strip()]
        if not names:
            raise ConfigError("--devices names no device")
        return names
    from powerlib.agent.authz import read_grants  # noqa: PLC0415 - the agent's grants format

    grants, _ = read_grants(grants_dir)
    grant = next((g for g in grants if g.job == job), None)
    if grant is None:
        raise ConfigError(
            f"no trusted grant for job {job!r} in {grants_dir} (powerlib agent grant writes it); "
            "give --devices instead"
        )
    if grant.uid != uid:
        raise ConfigError(f"job {job!r}'s grant is for uid {grant.uid}, not uid {uid}")
    return list(grant.devices)
