"""``powerlib agent``: the node daemon (``serve``), job grants (``grant``/``revoke``), ``leases``.

docs/agent.md has the design; the README's "On a cluster" section the systemd unit and the
Slurm prolog and epilog lines.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from powerlib.cli.options import Number, Options, emit_json, open_backend_for, settings_for
from powerlib.errors import ConfigError, PermissionDeniedError

__all__ = ["agent"]

DEFAULT_GRANTS = Path("/run/powerlib/grants")


@click.group()
def agent() -> None:
    """The node agent: jobs lock clocks and set power limits without root."""


@agent.command()
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to listen (default POWERLIB_AGENT_SOCKET, /run/powerlib/agent.sock); "
    "ignored under systemd socket activation.",
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
@click.option(
    "--grants-dir",
    type=click.Path(path_type=Path),
    default=DEFAULT_GRANTS,
    show_default=True,
    help="Where job grants live (powerlib agent grant).",
)
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
    help="Connections one uid may hold at once (root is not limited).",
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
    grants_dir: Path,
    line_timeout_s: float,
    max_per_uid: int,
    kubernetes: bool,
    pod_resources_socket: Path,
    cri_socket: Path,
    allow_non_root: bool,
) -> None:
    r"""Serve this node's devices to unprivileged jobs (run as root, one per node).

    \b
    powerlib agent serve --group powerlib --allow /etc/powerlib/agent-allow.json
    powerlib agent serve --kubernetes      # a DaemonSet: pods get the GPUs the kubelet gave them
    """
    from powerlib.agent.authz import Rules, load_allow_list  # noqa: PLC0415
    from powerlib.agent.server import Agent  # noqa: PLC0415

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
    settings = settings_for(opts)
    allow = load_allow_list(allow_path) if allow_path is not None else ()
    pods = None
    if kubernetes:
        from powerlib.agent.kubernetes import KubernetesGrants  # noqa: PLC0415

        pods = KubernetesGrants(pod_resources_socket, cri_socket)
    backend = open_backend_for(opts)
    try:
        server = Agent(
            backend,
            socket_path=socket_path or settings.agent_socket,
            rules=Rules(allow=allow, grants_dir=grants_dir, kubernetes=pods),
            group=group,
            socket_mode=mode,
            line_timeout_s=line_timeout_s,
            max_per_uid=max_per_uid,
        )
        server.run()
    finally:
        backend.close()


@agent.command()
@click.option("--job", required=True, help="The job id (Slurm: $SLURM_JOB_ID).")
@click.option(
    "--uid", type=str, required=True, help="The job's user (uid or name; $SLURM_JOB_UID)."
)
@click.option(
    "--devices",
    required=True,
    help="Comma-separated device indexes, UUIDs or PCI bus ids ($SLURM_JOB_GPUS).",
)
@click.option(
    "--grants-dir", type=click.Path(path_type=Path), default=DEFAULT_GRANTS, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print the grant as JSON.")
def grant(job: str, uid: str, devices: str, grants_dir: Path, as_json: bool) -> None:
    """Grant a job's user its devices (a Slurm prolog, as root)."""
    import pwd  # noqa: PLC0415

    from powerlib.agent.authz import write_grant  # noqa: PLC0415

    if os.geteuid() != 0:
        raise PermissionDeniedError("powerlib agent grant runs as root (in a Slurm prolog)")
    if uid.isdigit():
        uid_n = int(uid)
    else:
        try:
            uid_n = pwd.getpwnam(uid).pw_uid
        except KeyError:
            raise ConfigError(f"no such user {uid!r}") from None
    names = [d.strip() for d in devices.split(",") if d.strip()]
    path = write_grant(grants_dir, job, uid_n, names)
    if as_json:
        emit_json({"job": job, "uid": uid_n, "devices": names, "path": str(path)})
    else:
        click.echo(f"granted uid {uid_n} devices {','.join(names)} for job {job} ({path})")


@agent.command()
@click.option("--job", required=True, help="The job id (Slurm: $SLURM_JOB_ID).")
@click.option(
    "--grants-dir", type=click.Path(path_type=Path), default=DEFAULT_GRANTS, show_default=True
)
def revoke(job: str, grants_dir: Path) -> None:
    """Remove a job's grant (a Slurm epilog, as root)."""
    from powerlib.agent.authz import remove_grant  # noqa: PLC0415

    if os.geteuid() != 0:
        raise PermissionDeniedError("powerlib agent revoke runs as root (in a Slurm epilog)")
    removed = remove_grant(grants_dir, job)
    click.echo(f"{'revoked' if removed else 'no grant for'} job {job}")


@agent.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def leases(opts: Options, as_json: bool) -> None:
    """The devices the agent has leased (yours; root sees every lease)."""
    from powerlib.agent.client import AgentConnection  # noqa: PLC0415

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
