"""``powerlib agent``: the node daemon (``serve``), job grants (``grant``/``revoke``), ``leases``.

docs/agent.md has the design; docs/cluster.md the systemd unit and the
Slurm prolog and epilog lines.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from powerlib.cli.options import Number, Options, emit_json, open_backend_for, settings_for
from powerlib.config import NODE_STATE_DIR
from powerlib.errors import ConfigError, PermissionDeniedError, PowerlibError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from powerlib.device import Device

__all__ = ["agent"]

_GRANTS_HELP = (
    "Where job grants live (default: grants/ in root's state folder, POWERLIB_STATE_DIR, "
    f"normally {NODE_STATE_DIR / 'grants'})."
)


def _grants(opts: Options, grants_dir: Path | None) -> Path:
    """``--grants-dir``, or ``grants/`` in root's state folder (the node's layout)."""
    return grants_dir if grants_dir is not None else settings_for(opts).state_dir / "grants"


@click.group()
def agent() -> None:
    """The node agent: jobs lock clocks and set power limits without root."""


@agent.command()
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to listen (default POWERLIB_AGENT_SOCKET, /run/powerlib/agent/agent.sock). The "
    "socket's folder holds nothing else: pods mount it read-only, and the agent refuses to "
    "start when its state, grants or allow list lie in it. Ignored under systemd socket "
    "activation (the folder of the socket systemd passes is checked the same way).",
)
@click.option(
    "--group", default=None, help="Group that owns the socket (name or gid); default root's."
)
@click.option(
    "--mode",
    "socket_mode",
    default="0660",
    show_default=True,
    help="The socket's mode (octal).",
)
@click.option(
    "--allow",
    "allow_path",
    type=click.Path(path_type=Path),
    default=None,
    help="The allow list (JSON; root's, writable by nobody else).",
)
@click.option("--grants-dir", type=click.Path(path_type=Path), default=None, help=_GRANTS_HELP)
@click.option(
    "--line-timeout-s",
    type=Number(min=0.1, max=3600.0),
    default=10.0,
    show_default=True,
    help="How long a request line may stay incomplete before the connection is closed.",
)
@click.option(
    "--max-per-uid",
    type=click.IntRange(1, 1_000_000),
    default=128,
    show_default=True,
    help="Connections one uid (with --kubernetes: one pod, its root included) may hold at once; "
    "root on the host is not limited.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, 1_000_000),
    default=4096,
    show_default=True,
    help="Connections held at once, all clients together; a quarter of them at most by clients "
    "that no rule admits on any device, so they can never crowd out a granted job.",
)
@click.option(
    "--idle-timeout-s",
    type=Number(min=0.1, max=86400.0),
    default=60.0,
    show_default=True,
    help="Close a connection that holds no lease and sends nothing for this long (clients "
    "reconnect when they next need the agent).",
)
@click.option(
    "--kubernetes",
    is_flag=True,
    help="Also admit pods on the GPUs the kubelet allocated to them (pod-resources API + CRI; "
    "needs the kubernetes extra).",
)
@click.option(
    "--pod-resources-socket",
    type=click.Path(path_type=Path),
    default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
    show_default=True,
    help="With --kubernetes: the kubelet's pod-resources socket.",
)
@click.option(
    "--cri-socket",
    type=click.Path(path_type=Path),
    default=Path("/run/containerd/containerd.sock"),
    show_default=True,
    help="With --kubernetes: the container runtime's CRI socket (CRI-O: /var/run/crio/crio.sock).",
)
@click.option("--allow-non-root", is_flag=True, hidden=True, help="Tests: serve without root.")
@click.pass_obj
def serve(
    opts: Options,
    socket_path: Path | None,
    group: str | None,
    socket_mode: str,
    allow_path: Path | None,
    grants_dir: Path | None,
    line_timeout_s: float,
    max_per_uid: int,
    max_connections: int,
    idle_timeout_s: float,
    kubernetes: bool,
    pod_resources_socket: Path,
    cri_socket: Path,
    allow_non_root: bool,
) -> None:
    """Serve this node's devices to unprivileged jobs (run as root, one per node).

    \b
    powerlib agent serve --group powerlib --allow /etc/powerlib/agent-allow.json
    powerlib agent serve --kubernetes      # a DaemonSet: pods get the GPUs the kubelet gave them
    """  # noqa: D301 - "\b" is click's keep-these-lines marker (a backspace), not "\\b"
    from powerlib.agent.authz import Rules, load_allow_list  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.agent.transport import Agent  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if os.geteuid() != 0 and not allow_non_root:
        raise PermissionDeniedError(
            "powerlib agent serve runs as root (it changes device settings)"
        )
    try:
        mode = int(socket_mode, 8)
    except ValueError:
        raise ConfigError(f"--mode must be octal, got {socket_mode!r}") from None
    if mode & ~0o777 or mode & 0o002:
        raise ConfigError(f"--mode {socket_mode}: the socket must not be writable by others")
    if opts.verbose == 0:
        logging.basicConfig(
            level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr
        )
    from powerlib.agent.logs import queue_logging  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    # a log sink that stalls must never stall the event loop (docs/agent.md §5)
    log_queue = queue_logging()
    settings = settings_for(opts)
    allow = load_allow_list(allow_path) if allow_path is not None else ()
    pods = None
    if kubernetes:
        from powerlib.agent.kubernetes import KubernetesGrants  # noqa: PLC0415 - a command loads only what it runs (fast --help)

        pods = KubernetesGrants(pod_resources_socket, cri_socket)
    backend = open_backend_for(opts)
    try:
        server = Agent(
            backend,
            socket_path=socket_path or settings.agent_socket,
            rules=Rules(allow=allow, grants_dir=_grants(opts, grants_dir), kubernetes=pods),
            group=group,
            socket_mode=mode,
            line_timeout_s=line_timeout_s,
            max_per_uid=max_per_uid,
            max_connections=max_connections,
            idle_timeout_s=idle_timeout_s,
            allow_path=allow_path,
        )
        server.run()
    finally:
        backend.close()
        log_queue.stop()  # writes what is queued


def _clear_stale_grants(
    grants: Path, job: str, names: list[str], node: Sequence[Device]
) -> list[tuple[str, list[str]]]:
    """Take ``job``'s devices out of every other job's grant, a warning line for each.

    A device is one job's at a time: a grant a failed epilog left must not admit its user on
    this job's devices (docs/agent.md §3); the agent ends that user's leases of them. Any id
    form (index, UUID, PCI bus id) names the same device, as the agent resolves it
    (:func:`~powerlib.backend.match_device` over ``node``; no devices: compared as written).
    """
    from powerlib.agent.authz import clear_device_grants  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.backend import match_device  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    def device_id(selector: str) -> str | None:
        dev = match_device(node, selector)
        return None if dev is None else dev.device_id

    cleared = clear_device_grants(grants, job, names, device_id)
    for old_job, taken in cleared:
        click.echo(
            f"warning: took {','.join(taken)} out of job {old_job}'s grant (left by a failed "
            "epilog?); its leases of them end",
            err=True,
        )
    return cleared


@agent.command()
@click.option("--job", required=True, help="The job id (Slurm: $SLURM_JOB_ID).")
@click.option(
    "--uid", type=str, required=True, help="The job's user (uid or name; $SLURM_JOB_UID)."
)
@click.option(
    "--devices",
    default=None,
    help="Comma-separated device UUIDs, PCI bus ids or indexes (in the agent's order).",
)
@click.option(
    "--slurm-gpus",
    default=None,
    metavar="MINORS",
    help="Slurm's GPU list ($SLURM_JOB_GPUS): device minor numbers (/dev/nvidiaN), which need "
    "not follow the agent's PCI order; each is resolved to its UUID on this node.",
)
@click.option("--grants-dir", type=click.Path(path_type=Path), default=None, help=_GRANTS_HELP)
@click.option(
    "--user-state/--no-user-state",
    default=True,
    show_default=True,
    help="Also create the user's state folder <state>/users/UID (0700, theirs), where their "
    "sessions journal by default instead of /tmp.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the grant as JSON.")
@click.pass_obj
def grant(
    opts: Options,
    job: str,
    uid: str,
    devices: str | None,
    slurm_gpus: str | None,
    grants_dir: Path | None,
    user_state: bool,
    as_json: bool,
) -> None:
    """Grant a job's user its devices (a Slurm prolog, as root).

    \b
    powerlib agent grant --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID" --slurm-gpus "$SLURM_JOB_GPUS"
    """  # noqa: D301 - "\b" is click's keep-these-lines marker (a backspace), not "\\b"
    import pwd  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    from powerlib.agent.authz import write_grant  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.agent.node import make_user_state_dir, uuids_of_minors  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if os.geteuid() != 0:
        raise PermissionDeniedError("powerlib agent grant runs as root (in a Slurm prolog)")
    if uid.isdigit():
        uid_n = int(uid)
    else:
        try:
            uid_n = pwd.getpwnam(uid).pw_uid
        except KeyError:
            raise ConfigError(f"no such user {uid!r}") from None
    if (devices is None) == (slurm_gpus is None):
        raise ConfigError("give the job's devices with --devices or --slurm-gpus (one of them)")
    try:
        backend = open_backend_for(opts)
    except PowerlibError:
        if slurm_gpus is not None:
            raise
        backend = None  # --devices alone needs no backend: other grants compared as written
    try:
        if slurm_gpus is not None:
            assert backend is not None
            minors = [m.strip() for m in slurm_gpus.split(",") if m.strip()]
            names = uuids_of_minors(backend, minors)
        else:
            names = [d.strip() for d in (devices or "").split(",") if d.strip()]
        folder = None
        if user_state:  # first: a folder that is not the user's alone fails the prolog, no grant
            folder = make_user_state_dir(settings_for(opts).state_dir, uid_n)
        grants = _grants(opts, grants_dir)
        node = [] if backend is None else backend.devices()
        cleared = _clear_stale_grants(grants, job, names, node)
    finally:
        if backend is not None:
            backend.close()
    path = write_grant(grants, job, uid_n, names)
    if as_json:
        emit_json(
            {
                "job": job,
                "uid": uid_n,
                "devices": names,
                "path": str(path),
                "user_state_dir": None if folder is None else str(folder),
                "cleared": [{"job": j, "devices": d} for j, d in cleared],
            }
        )
    else:
        click.echo(f"granted uid {uid_n} devices {','.join(names)} for job {job} ({path})")


@agent.command()
@click.option("--job", required=True, help="The job id (Slurm: $SLURM_JOB_ID).")
@click.option("--grants-dir", type=click.Path(path_type=Path), default=None, help=_GRANTS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@click.pass_obj
def revoke(opts: Options, job: str, grants_dir: Path | None, as_json: bool) -> None:
    """Remove a job's grant and end its leases (a Slurm epilog, as root).

    The grant file goes first, so nothing more is admitted by it; then the agent is asked to
    end (and restore) every lease the grant admitted, a process of the user's started outside
    the job included, and this returns once they are restored. Without a running agent only
    the file is removed.
    """
    from powerlib.agent.authz import remove_grant  # noqa: PLC0415 - a command loads only what it runs (fast --help)
    from powerlib.agent.client import AgentConnection  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if os.geteuid() != 0:
        raise PermissionDeniedError("powerlib agent revoke runs as root (in a Slurm epilog)")
    removed = remove_grant(_grants(opts, grants_dir), job)
    ended: list[dict[str, object]] | None = None
    left_out, left_out_failed = 0, 0
    note = ""
    try:
        conn = AgentConnection(settings_for(opts).agent_socket)
    except PowerlibError as err:
        note = f"; no agent to ask ({err.message})"
    else:
        try:
            answer = conn.call("revoke", job=job)
            if isinstance(answer, dict):  # the latest leases, and a count of the earlier ones
                ended = list(answer.get("ended") or ())
                left_out = int(answer.get("left_out") or 0)
                left_out_failed = int(answer.get("left_out_failed") or 0)
            else:  # an agent before the bounded answer: every lease, listed
                ended = list(answer or ())
        except PowerlibError as err:  # the grant is gone: the agent ends its leases within 1 s
            note = f"; the agent did not answer ({err.message}), it ends the leases by itself"
        finally:
            conn.close()
    failed = [e for e in ended or () if not e.get("ok")]
    ok = not failed and not left_out_failed
    if as_json:
        emit_json(
            {
                "job": job,
                "removed": removed,
                "leases_ended": ended,
                "leases_left_out": left_out,
                "leases_left_out_failed": left_out_failed,
                "ok": ok,
            }
        )
    else:
        what = "revoked" if removed else "no grant for"
        leases = "" if ended is None else f"; {len(ended) + left_out} lease(s) ended and restored"
        click.echo(f"{what} job {job}{leases}{note}")
    if not ok:
        named = ", ".join(str(e["device_id"]) for e in failed)
        earlier = f"{left_out_failed} earlier one(s) not listed" if left_out_failed else ""
        raise PowerlibError(
            f"job {job}: {len(failed) + left_out_failed} lease(s) did not restore cleanly (see "
            f"the agent's log): " + ", ".join(x for x in (named, earlier) if x)
        )


@agent.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def leases(opts: Options, as_json: bool) -> None:
    """The devices the agent has leased (yours; root sees every lease)."""
    from powerlib.agent.client import AgentConnection  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    conn = AgentConnection(settings_for(opts).agent_socket)
    try:
        rows = conn.call("leases")
    finally:
        conn.close()
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no leases")
    for r in rows:
        click.echo(f"{r['device_id']}  uid {r['uid']}  pid {r['pid']}  {r['rule']}")
