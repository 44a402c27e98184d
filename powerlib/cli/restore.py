"""``powerlib restore``: put devices back from the journals sessions left behind.

One call to :func:`powerlib.control.restore_journals`; this module only formats its outcomes.
"""

from __future__ import annotations

import os

import click

from powerlib.cli.options import Options, emit_json
from powerlib.config import Settings
from powerlib.control import RestoreOutcome, restore_failure, restore_journals
from powerlib.errors import PowerlibError
from powerlib.inspection import SCHEMA_VERSION

__all__ = ["restore"]


def _trust_owner_uids(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> tuple[int, ...]:
    """``--trust-owner`` values (uids or user names) as uids."""
    import pwd

    uids = []
    for value in values:
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
    "--trust-owner",
    "trusted_uids",
    metavar="UID",
    multiple=True,
    callback=_trust_owner_uids,
    help=(
        "Also act on a state folder and journals owned by this user (uid or name), e.g. the "
        'Slurm job\'s: --trust-owner "$SLURM_JOB_UID". Repeatable. Only the owner rule is '
        "relaxed: group/world-writable files, symlinks and fifos are still refused."
    ),
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def restore(
    opts: Options, mode: str, dry_run: bool, trusted_uids: tuple[int, ...], as_json: bool
) -> None:
    """Put devices back from the journals that sessions left in the state directory.

    A session journals each device's original settings before changing it and deletes the
    journal once it has restored them; a journal left behind means its owner was killed
    (SIGKILL, OOM, crash). Run this from a Slurm epilog or a systemd unit to clean up a node.
    Each journal reopens the backend it was written with; --backend is ignored here.

    Only trusted state is acted on: folders and journals owned by you or root (or a
    --trust-owner), not writable by group or others, real folders and regular files. Anything
    else is refused with one line naming its path, owner and mode (exit 12). After restoring,
    each device is read back; whatever is still modified is listed and the exit code is
    non-zero.
    """
    settings = Settings.from_env()
    report: dict[str, object] = {
        "schema": f"powerlib.restore.v{SCHEMA_VERSION}",
        "state_dir": str(settings.state_dir),
        "mode": mode,
        "dry_run": dry_run,
        "trusted_uids": sorted({os.geteuid(), 0, *trusted_uids}),
    }
    try:
        outcomes = restore_journals(
            settings, include_live=mode == "all", dry_run=dry_run, trusted_uids=trusted_uids
        )
    except PowerlibError as err:  # the state folder itself: nothing was done
        if as_json:
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
            emit_json(report)
        raise
    failure = restore_failure(outcomes)
    if as_json:
        report.update(
            ok=failure is None,
            error=None if failure is None else str(failure),
            exit_code=0 if failure is None else failure.exit_code,
            outcomes=[o.to_json() for o in outcomes],
            still_modified=[_still_modified(o) for o in outcomes if not o.ok],
        )
        emit_json(report)
    elif not outcomes:
        click.echo(f"nothing to restore in {settings.state_dir}")
    else:
        for o in outcomes:
            owner = f" (journal of pid {o.owner_pid})" if o.owner_pid is not None else ""
            line = f"{o.device_id} {o.item}: {o.action}{owner}"
            click.echo(click.style(line, fg=None if o.ok else "red"))
    if failure is not None:
        raise failure
