"""Who may touch which device: the agent's rules (docs/agent.md §3). Default deny.

Two sources grant a uid (or a group) devices, each by any id form (index, UUID, PCI bus id):

* **The allow list** (``--allow FILE``): an administrator's standing rules, read at start. The
  file and its folder must be root's and writable by nobody else, else the agent refuses to
  start: a rule that any user could edit would hand the node's GPUs to that user. ::

      {"rules": [{"name": "ml-team", "group": "ml", "devices": ["*"]},
                 {"name": "bench", "uid": 1001, "devices": ["0", "GPU-4f3c..."]}]}

* **Job grants** (``--grants-dir``, default ``/run/powerlib/grants``): one file per job, written
  by the Slurm prolog (``powerlib agent grant --job "$SLURM_JOB_ID" --uid "$SLURM_JOB_UID"
  --devices "$SLURM_JOB_GPUS"``) and removed by the epilog (``powerlib agent revoke``). Read at
  each check, so a grant takes effect at once; a grant file or folder that is not root's, is a
  symlink, or is writable by group or others is ignored (and said in the refusal). A device is
  one job's at a time: the grant command takes the new job's devices out of every other job's
  grant (one a failed epilog left). A folder or grant file that cannot be read (out of file
  descriptors, an I/O error) keeps its last good reading, so such a failure ends no job's leases.

Every refusal names the device, the uid and the rule that decided (or that none matched).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import json
import logging
import os
import pwd
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.agent.protocol import one_line
from powerlib.control import check_trusted
from powerlib.errors import ConfigError, UntrustedStateError
from powerlib.inputs import show_path

__all__ = [
    "Grant",
    "Rules",
    "clear_device_grants",
    "load_allow_list",
    "read_grants",
    "remove_grant",
    "write_grant",
]

logger = logging.getLogger(__name__)

_MAX_FILE_BYTES = 1 << 20
_MAX_RULES = 4096
_JOB = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # fullmatch: a trailing newline is refused
ROOT_ONLY = frozenset({0})
_GRANTS_TTL_S = 0.5
"""The longest an unchanged grants folder's reading is used before it is read again."""
_SETTLE_NS = 2_000_000_000
"""A folder changed less than this before a read is read again at the next check (file times
are coarse: a clock tick on tmpfs and ext4, a second on some filesystems)."""
_Reading = tuple[tuple[int, ...] | None, float, tuple["Grant", ...], tuple[str, ...]]
"""A reading of the grants folder: its key (None: read it again), when (monotonic s), the
grants, the lines of the files ignored."""


@dataclass(frozen=True, slots=True)
class Grant:
    """One rule: who (a uid, or members of a gid) may control which devices.

    Attributes:
        rule: How a refusal or a lease names it (``allow:ml-team``, ``job:1234``).
        uid: The uid it grants, or ``None``.
        gid: The gid whose members it grants, or ``None``.
        devices: Device selectors in any id form, or ``("*",)`` for every device.
        job: The job id of a job grant.
    """

    rule: str
    uid: int | None
    gid: int | None
    devices: tuple[str, ...]
    job: str | None = None

    def admits(self, uid: int, gids: Iterable[int]) -> bool:
        """Whether this rule speaks for that client."""
        return (self.uid is not None and self.uid == uid) or (
            self.gid is not None and self.gid in set(gids)
        )


@dataclass
class Rules:
    """The allow list plus the job grants, and the check the agent makes for each request.

    Args:
        allow: The allow list's rules (read once at start).
        grants_dir: Where job grants live, or ``None``.
        resolve: Maps a selector in any id form to a device's canonical id (``None`` when no
            device matches).
    """

    allow: tuple[Grant, ...] = ()
    grants_dir: Path | None = None
    resolve: Callable[[str], str | None] = lambda s: None
    kubernetes: Any = None
    """A :class:`~powerlib.agent.kubernetes.KubernetesGrants`, or None (not on Kubernetes)."""
    _cache: _Reading | None = field(default=None, repr=False)
    _ignored_logged: tuple[str, ...] = field(default=(), repr=False)
    _last_good: dict[str, Grant] = field(default_factory=dict, repr=False)
    """The grants read last, by file name: what a file or folder that cannot be read keeps."""
    _failed_logged: tuple[str, ...] = field(default=(), repr=False)

    def grants(self) -> tuple[tuple[Grant, ...], tuple[str, ...]]:
        """The job grants now, and a line per grant file that was ignored.

        The folder is read again whenever its ``lstat`` (inode, mtime, ctime) differs from the
        one before the last read: writing or removing a grant changes the folder's mtime, so the
        first check after ``powerlib agent revoke`` returns no longer admits its job (docs/agent.md
        §3). An unchanged folder is read again every :data:`_GRANTS_TTL_S` at most (a grant file
        changed in place). File times are coarse (a clock tick, a second on some filesystems),
        so a folder that changed within :data:`_SETTLE_NS` of a read is read again on each check:
        a change in the same tick would leave its times as they were. Each newly ignored file is
        logged once; refusals never name grant files (they are other jobs').
        """
        if self.grants_dir is None:
            return (), ()
        key = _folder_key(self.grants_dir)
        now = time.monotonic()
        cache = self._cache
        if cache is not None and cache[0] == key and now - cache[1] < _GRANTS_TTL_S:
            return cache[2], cache[3]
        settled = not key or time.time_ns() - max(key[1], key[2]) >= _SETTLE_NS
        found, ignored = self._read_keeping_last_good(self.grants_dir)
        self._cache = (key if settled else None, now, tuple(found), tuple(ignored))
        if self._cache[3] != self._ignored_logged:
            for line in self._cache[3]:
                if line not in self._ignored_logged:
                    logger.warning("agent: ignoring a job grant: %s", one_line(line))
            self._ignored_logged = self._cache[3]
        return self._cache[2], self._cache[3]

    def invalidate(self, revoked: str | None = None) -> None:
        """Forget the grants read so far: the next check reads the folder again.

        Args:
            revoked: A job whose grant was revoked: dropped from the last good reading too, so
                a folder that cannot be read then does not keep admitting it.
        """
        self._cache = None
        if revoked is not None:
            self._last_good = {n: g for n, g in self._last_good.items() if g.job != revoked}

    def _read_keeping_last_good(self, folder: Path) -> tuple[list[Grant], list[str]]:
        """Read the grants; a folder or file that could not be read keeps its last good grants.

        Running out of file descriptors or an I/O error is not a revoke: answering "no grants"
        would end every job's leases at the next housekeeping (docs/agent.md §3). A file that is
        gone, untrusted or malformed is not a read failure: its grant ends. Each new failure is
        logged once.
        """
        found, ignored, failed = _scan_grants(folder)
        if "" in failed:  # the folder itself: every grant as last read
            found = dict(self._last_good)
        else:
            found.update((n, self._last_good[n]) for n in failed if n in self._last_good)
        self._last_good = dict(sorted(found.items()))
        lines = tuple(failed.values())
        if lines and lines != self._failed_logged:
            logger.warning(
                "agent: cannot read the job grants (%s): keeping the last good reading of %d "
                "grant(s) until they can be read",
                one_line("; ".join(lines)),
                len(self._last_good),
            )
        self._failed_logged = lines
        return list(self._last_good.values()), ignored

    def check(
        self, uid: int, gids: Iterable[int], device_id: str, shown: str, pid: int | None = None
    ) -> tuple[bool, str]:
        """Whether ``uid`` (with ``gids``; process ``pid``) may control ``device_id``, and why.

        Root is admitted (it could drive the device without the agent anyway), except a process
        in a Kubernetes pod: a container's uid 0 is the host's without user namespaces. A pod's
        process may control the devices the kubelet allocated to its container.
        """
        gids = tuple(gids)
        if self.kubernetes is not None and pid is not None and self.kubernetes.in_pod(pid):
            # Inside a pod, the pod's verdict is the only verdict (docs/agent.md §3): never the
            # uid, group or job-grant rules, which a container's uid (0, or an allow-listed uid
            # it chose to run as) would otherwise reach.
            pod = self.kubernetes.devices_of(pid)
            if pod is None:
                return False, (
                    f"uid {uid} may not control device {shown}: pid {pid} runs in a pod this "
                    "agent cannot place"
                )
            if any(self.resolve(d) == device_id for d in pod.devices):
                return True, pod.rule
            given = ", ".join(pod.devices) or "no GPUs"
            return False, (
                f"uid {uid} may not control device {shown}: {pod.rule} was allocated {given} by "
                "the kubelet"
            )
        if uid == 0:
            if self.kubernetes is not None and pid is not None:
                if not self.kubernetes.is_host_process(pid):
                    return False, (
                        f"uid {uid} may not control device {shown}: pid {pid} runs in a pid "
                        "namespace of its own (a container this agent cannot place), and a "
                        "container's uid 0 is not the host's root"
                    )
            return True, "root"
        job_grants, _ = self.grants()  # ignored files are logged, never told to a client
        matched: list[Grant] = []
        for grant in (*self.allow, *job_grants):
            if not grant.admits(uid, gids):
                continue
            if "*" in grant.devices or any(self.resolve(s) == device_id for s in grant.devices):
                return True, grant.rule
            matched.append(grant)
        if matched:
            names = ", ".join(g.rule for g in matched)
            why = f"{names} grant{'' if len(matched) > 1 else 's'} uid {uid} other devices only"
        else:
            why = f"no allow-list rule or job grant names uid {uid} (default deny)"
        return False, f"uid {uid} may not control device {one_line(shown, 200)}: {why}"


# -- the allow list --------------------------------------------------------------------------------


def load_allow_list(path: Path) -> tuple[Grant, ...]:
    """Read the administrator's allow list, refusing one that is not root's alone.

    Raises:
        UntrustedStateError: The file or its folder is not root's, is a symlink, or is writable
            by group or others.
        ConfigError: The file is malformed (the message names the rule).
    """
    parent = path.parent
    check_trusted(
        parent, os.lstat(parent), what="allow list's folder", directory=True, trusted_uids=ROOT_ONLY
    )
    data = _read_trusted_json(path, "allow list")
    if not isinstance(data, Mapping) or not isinstance(data.get("rules"), list):
        raise ConfigError(f'allow list {show_path(path)}: expected {{"rules": [...]}}')
    rules = data["rules"]
    if len(rules) > _MAX_RULES:
        raise ConfigError(f"allow list {show_path(path)}: more than {_MAX_RULES} rules")
    out = []
    for i, raw in enumerate(rules):
        try:
            out.append(_rule(raw, i))
        except (TypeError, ValueError, KeyError) as err:
            raise ConfigError(f"allow list {show_path(path)}: rule {i}: {err}") from None
    return tuple(out)


def _rule(raw: Any, i: int) -> Grant:
    if not isinstance(raw, Mapping):
        raise TypeError("not an object")
    unknown = sorted(set(raw) - {"name", "uid", "user", "gid", "group", "devices"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}")
    name = str(raw.get("name", f"rule-{i}"))[:64]
    uid = _id(raw, "uid", "user", lambda n: pwd.getpwnam(n).pw_uid)
    gid = _id(raw, "gid", "group", lambda n: grp.getgrnam(n).gr_gid)
    if (uid is None) == (gid is None):
        raise ValueError("give exactly one of uid, user, gid, group")
    return Grant(rule=f"allow:{name}", uid=uid, gid=gid, devices=_devices(raw.get("devices")))


def _id(raw: Mapping[str, Any], num: str, name: str, lookup: Callable[[str], int]) -> int | None:
    if num in raw and name in raw:
        raise ValueError(f"give {num} or {name}, not both")
    if num in raw:
        value = raw[num]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{num} must be a non-negative integer")
        return value
    if name in raw:
        try:
            return lookup(str(raw[name]))
        except KeyError:
            raise ValueError(f"no such {name} {raw[name]!r}") from None
    return None


def _devices(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("devices must be a non-empty list")
    out = []
    for d in value:
        if isinstance(d, bool) or not isinstance(d, (str, int)):
            raise ValueError(f"device {d!r} is not an index or an id")
        text = str(d).strip()
        if not (0 < len(text) <= 128):
            raise ValueError(f"device {d!r} is empty or too long")
        out.append(text)
    return tuple(out)


class _ReadFailed(ConfigError):
    """A file that exists could not be read (no descriptor left, an I/O error).

    Not a verdict on its content: a grant that was good stays good (:meth:`Rules.grants`).
    """


def _read_trusted_json(path: Path, what: str) -> Any:
    """Open without following links, check the opened file itself, then parse (bounded)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        if os.path.islink(path):
            raise UntrustedStateError(
                f"refusing the {what} {show_path(path)}: it is a symlink"
            ) from None
        gone = err.errno in (errno.ENOENT, errno.ENOTDIR)  # removed: its verdict is "none"
        raise (ConfigError if gone else _ReadFailed)(
            f"cannot open the {what} {show_path(path)}: {err.strerror}"
        ) from None
    try:
        check_trusted(path, os.fstat(fd), what=what, directory=False, trusted_uids=ROOT_ONLY)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    except OSError as err:
        raise _ReadFailed(f"cannot read the {what} {show_path(path)}: {err.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(f"the {what} {show_path(path)} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"the {what} {show_path(path)} is not JSON: {err}") from None
    except RecursionError:  # [[[[... : the decoder's depth limit, not the caller's problem
        raise ConfigError(f"the {what} {show_path(path)} is nested too deeply") from None


# -- job grants ------------------------------------------------------------------------------------


def _folder_key(folder: Path) -> tuple[int, ...]:
    """The folder's inode and times, which a grant written, removed or renamed changes.

    ``()`` when there is no folder.
    """
    try:
        st = os.lstat(folder)
    except OSError:
        return ()
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_dev)


def read_grants(folder: Path) -> tuple[list[Grant], list[str]]:
    """Every trusted job grant in ``folder``, and a line for each file that was ignored.

    Each file stands alone: one that is not root's, not JSON, nested too deeply or malformed in
    any way is ignored (a line says why) and the others still count (docs/agent.md §3). A file
    or folder that could not be read is ignored here too (:meth:`Rules.grants` keeps its last
    good reading instead).
    """
    found, ignored, failed = _scan_grants(folder)
    return list(found.values()), ignored + list(failed.values())


def _scan_grants(folder: Path) -> tuple[dict[str, Grant], list[str], dict[str, str]]:
    """The trusted grants by file name, the files ignored (a line each), the read failures.

    The failures are by file name, ``""`` for the folder itself (it could not be listed).
    """
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return {}, [], {}
    except OSError as err:
        return {}, [], {"": f"cannot read the grants folder {show_path(folder)}: {err.strerror}"}
    try:
        check_trusted(folder, st, what="grants folder", directory=True, trusted_uids=ROOT_ONLY)
    except UntrustedStateError as err:
        return {}, [err.message], {}
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:  # removed since the lstat: no grants
        return {}, [], {}
    except OSError as err:
        return {}, [], {"": f"cannot list the grants folder {show_path(folder)}: {err.strerror}"}
    found: dict[str, Grant] = {}
    ignored: list[str] = []
    failed: dict[str, str] = {}
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        try:
            data = _read_trusted_json(Path(entry.path), "job grant")
            found[entry.name] = _grant(data)
        except _ReadFailed as err:
            failed[entry.name] = err.message
        except (UntrustedStateError, ConfigError) as err:
            ignored.append(err.message)
        except (TypeError, ValueError, KeyError) as err:
            ignored.append(f"job grant {show_path(entry.path)} is malformed: {err}")
        except Exception as err:  # noqa: BLE001 - one bad file must not break every check
            ignored.append(
                f"job grant {show_path(entry.path)} could not be read: {type(err).__name__}"
            )
    return found, ignored, failed


def _grant(data: Any) -> Grant:
    if not isinstance(data, Mapping):
        raise TypeError("not an object")
    job = data["job"]
    if not (isinstance(job, str) and _JOB.fullmatch(job)):
        raise ValueError("job must be 1-64 of [A-Za-z0-9_.-]")
    uid = data["uid"]
    if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
        raise ValueError("uid must be a non-negative integer")
    return Grant(rule=f"job:{job}", uid=uid, gid=None, devices=_devices(data["devices"]), job=job)


def write_grant(folder: Path, job: str, uid: int, devices: Iterable[str]) -> Path:
    """Write a job grant (root, in a Slurm prolog): ``folder/job-<job>.json``, 0600, atomically.

    Raises:
        ConfigError: A bad job id, uid or device list.
        UntrustedStateError: The folder exists but is not root's alone.
    """
    if not _JOB.fullmatch(job):
        raise ConfigError(f"job id {job!r} must be 1-64 of [A-Za-z0-9_.-]")
    if uid < 0:
        raise ConfigError(f"uid must be non-negative, got {uid}")
    try:
        devs = _devices([d for d in devices])
    except ValueError as err:
        raise ConfigError(f"devices: {err}") from None
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # who runs which job: root's only
    check_trusted(
        folder, os.lstat(folder), what="grants folder", directory=True, trusted_uids=ROOT_ONLY
    )
    with _folder_lock(folder):
        return _replace_grant(folder, f"job-{job}.json", job, uid, devs)


def _replace_grant(folder: Path, name: str, job: str, uid: int, devs: Iterable[str]) -> Path:
    """Write ``folder/name`` (0600) through a temporary file and a rename.

    Readers see the old grant or the new one, never half of one.
    """
    target = folder / name
    tmp = folder / f".{name}.tmp"
    body = json.dumps({"job": job, "uid": uid, "devices": list(devs), "created_s": time.time()})
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    return target


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Hold the grants folder's lock while a grant is written, cleared or removed.

    A prolog clearing a stale grant and that job's late epilog removing it then run one after
    the other: a cleared grant rewritten after its removal would come back.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def clear_device_grants(
    folder: Path, job: str, devices: Iterable[str], resolve: Callable[[str], str | None]
) -> list[tuple[str, list[str]]]:
    """Take ``job``'s devices out of every other job's grant (the prolog, before its own grant).

    A device is one job's at a time (docs/agent.md §3): a grant a failed epilog left would
    otherwise admit its user on the next job's device. A grant left naming no device, or one
    naming every device (``*``), is removed; the agent ends a lease whose job's grant no longer
    names its device within its housekeeping period (half a second).

    Args:
        folder: The grants folder.
        job: The new job (its own grant is left alone).
        devices: The new job's devices, any id form.
        resolve: A selector's device id on this node, or ``None`` (then selectors are compared
            as written, case aside).

    Returns:
        For each grant changed: its job and the selectors taken out of it.
    """

    def key(selector: str) -> str:
        return resolve(selector) or selector.strip().lower()

    taking = {key(d) for d in devices}
    cleared: list[tuple[str, list[str]]] = []
    if not folder.is_dir():
        return cleared  # no folder yet: no grants
    with _folder_lock(folder):
        found, _, _ = _scan_grants(folder)  # trusted grants only: the others admit no one
        for name, grant in found.items():
            if grant.job == job or grant.job is None:
                continue
            taken = [d for d in grant.devices if d == "*" or key(d) in taking]
            if not taken:
                continue
            left = [d for d in grant.devices if d not in taken]
            if left and "*" not in taken and grant.uid is not None:
                _replace_grant(folder, name, grant.job, grant.uid, left)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(folder / name)
            cleared.append((grant.job, taken))
    return cleared


def remove_grant(folder: Path, job: str) -> bool:
    """Remove a job's grant (the epilog); False when there was none."""
    if not _JOB.fullmatch(job):
        raise ConfigError(f"job id {job!r} must be 1-64 of [A-Za-z0-9_.-]")
    try:
        with _folder_lock(folder):
            os.unlink(folder / f"job-{job}.json")
    except FileNotFoundError:
        return False
    return True
