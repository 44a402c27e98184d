"""Kubernetes grants: a pod's client may control the GPUs the kubelet gave that pod's container.

The chain of trust, each link from something the client cannot forge (docs/agent.md §3):

1. **Which container.** The client's pid comes from the kernel (``SO_PEERCRED``); its cgroup
   (``/proc/<pid>/cgroup``, kernel-kept) names the pod's UID and the container's id. Only the
   kubelet's own layouts count, anchored at the cgroup root: systemd
   (``/kubepods.slice/[kubepods-<qos>.slice/]kubepods[-<qos>]-pod<uid>.slice/<runtime>-<id>.scope``,
   runtime ``cri-containerd``, ``crio``, ``docker``) and cgroupfs
   (``/kubepods/[<qos>/]pod<uid>/<id>``). A path that only mentions a pod deeper down (a user's
   systemd-delegated ``user@UID.service/…/kubepods-…-pod<uid>.slice``) is a host process's. Every
   line under ``kubepods`` (cgroup v1 has one per hierarchy) must name the same container, and the
   pod's and the container's cgroup folders must be root's alone, checked on the cgroup
   filesystem: nobody but root can then have put the process there.
2. **Which pod, and is it that container's process.** The container runtime (CRI
   ``RuntimeService.ContainerStatus``, verbose) gives the container's labels (pod name,
   namespace, UID, container name; the UID must match the cgroup's), its state (it must be
   running) and its init's host pid: the client must share that process's pid namespace, and a
   container in the host's pid namespace (``hostPID``) must have its init in the same container
   cgroup as the client.
3. **Which devices.** The kubelet's pod-resources API (``PodResourcesLister.List``) gives the
   device ids each container was allocated (``nvidia.com/gpu``: GPU UUIDs; AMD: PCI bus ids),
   which the agent resolves like any other id form.

A client outside every pod (a host process) gets nothing from here; one inside a pod gets only
its container's devices, even as uid 0 (a container's root is the host's root without user
namespaces, so the agent does not admit it as root). A cgroup that cannot be read or placed
(malformed, lines that disagree, an unknown layout under ``kubepods``) counts as a pod and is
refused. Both services are gRPC on Unix sockets; ``grpcio`` (the ``kubernetes`` extra) carries
the calls and this module reads and writes the few protobuf fields it needs itself.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerlib.errors import BackendUnavailableError, ConfigError

__all__ = [
    "DEFAULT_CRI_SOCKET",
    "DEFAULT_POD_RESOURCES_SOCKET",
    "GPU_RESOURCES",
    "KubernetesGrants",
    "PodDevices",
    "cgroup_mount",
    "container_of_cgroup",
]

DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_CRI_SOCKET = Path("/run/containerd/containerd.sock")
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
_LIST_PODS = "/v1.PodResourcesLister/List"
_CONTAINER_STATUS = "/runtime.v1.RuntimeService/ContainerStatus"
_CONTAINER_RUNNING = 1  # CRI ContainerState.CONTAINER_RUNNING
# A pod's UID in its cgroup: a UUID (``_`` for ``-`` in systemd's unit names), or the 32 hex
# digits of a static pod's.
_UID_SYSTEMD = r"[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}|[0-9a-f]{32}"
_UID_CGROUPFS = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}"
_SYSTEMD_LAYOUT = re.compile(
    r"/kubepods\.slice/(?:kubepods-(?P<qos>burstable|besteffort)\.slice/kubepods-(?P=qos)-"
    rf"|kubepods-)pod(?P<pod>{_UID_SYSTEMD})\.slice"
    r"/(?:cri-containerd|crio|docker|containerd)-(?P<cid>[0-9a-f]{64})\.scope"
)
_CGROUPFS_LAYOUT = re.compile(
    rf"/kubepods/(?:(?:burstable|besteffort)/)?pod(?P<pod>{_UID_CGROUPFS})/(?P<cid>[0-9a-f]{{64}})"
)
_LINE = re.compile(r"(?P<id>[0-9]+):(?P<controllers>[^:]*):(?P<path>/.*)")
_TIMEOUT_S = 5.0
_CACHE_S = 5.0
_VERDICT_S = 2.0


@dataclass(frozen=True, slots=True)
class PodDevices:
    """What the kubelet allocated to one client's container.

    Attributes:
        rule: How refusals and leases name it: ``pod:<namespace>/<pod>/<container>``.
        devices: The device ids the kubelet reported (UUIDs or PCI bus ids).
    """

    rule: str
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where ``/proc/<pid>/cgroup`` puts a process (docs/agent.md §3, Kubernetes, link 1).

    A host process has neither ``pod_uid`` nor ``problem``; a pod's process has ``pod_uid``,
    ``container_id`` and, per line under ``kubepods``, ``(controllers, the container's cgroup
    folder)``; one that cannot be placed has ``problem`` (and is refused: it fails closed).
    """

    pod_uid: str | None = None
    container_id: str | None = None
    folders: tuple[tuple[str, str], ...] = ()
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class _Status:
    """The fields of a CRI ``ContainerStatusResponse`` the check needs."""

    container_id: str
    state: int
    labels: dict[str, str]
    pid: int | None


def _place(text: str) -> _Placement:
    """Place a process by its ``/proc/<pid>/cgroup`` text (docs/agent.md §3, Kubernetes).

    Only the kubelet's layouts anchored at the cgroup root count; every line anchored under
    ``kubepods`` must name the same pod and container. Text that cannot be read, a malformed line,
    a hierarchy listed twice, a path outside this process's cgroup namespace (``/..``) or an
    unknown layout under ``kubepods`` cannot be placed.
    """
    if not text.strip():
        return _Placement(problem="could not be read")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    seen: set[str] = set()
    found: set[tuple[str, str]] = set()
    folders: list[tuple[str, str]] = []
    for line in lines:
        m = _LINE.fullmatch(line)
        if m is None:
            return _Placement(problem="has a line that is not `id:controllers:/path`")
        if m["id"] in seen:
            return _Placement(problem=f"lists hierarchy {m['id']} twice")
        seen.add(m["id"])
        path = m["path"]
        parts = path.split("/")[1:]
        if ".." in parts or "." in parts:
            return _Placement(problem="lies outside the agent's cgroup namespace")
        if parts[0] not in ("kubepods.slice", "kubepods"):
            continue  # the host's (a user's delegated cgroups included), whatever it mentions
        layout = _SYSTEMD_LAYOUT if parts[0] == "kubepods.slice" else _CGROUPFS_LAYOUT
        pod = layout.match(path)
        if pod is None or pod.end() < len(path) and path[pod.end()] != "/" or "//" in path:
            return _Placement(problem="names no pod and container this agent knows")
        found.add((pod["pod"].replace("_", "-"), pod["cid"]))
        folders.append((m["controllers"], path[: pod.end()]))
    if len(found) > 1:
        return _Placement(problem="names different pods or containers in different hierarchies")
    if not found:
        return _Placement()
    pod_uid, container_id = found.pop()
    return _Placement(pod_uid, container_id, tuple(folders))


def container_of_cgroup(text: str) -> tuple[str, str] | None:
    """``(pod UID, container id)`` from ``/proc/<pid>/cgroup``'s text, or None if none is named.

    Only the kubelet's layouts anchored at the cgroup root count (docs/agent.md §3); the
    container's folder may hold cgroups of its own (systemd inside a container:
    ``…/cri-containerd-<id>.scope/init.scope``). None also for text that cannot be placed.
    """
    placed = _place(text)
    if placed.problem is not None or placed.pod_uid is None or placed.container_id is None:
        return None
    return placed.pod_uid, placed.container_id


def cgroup_mount(controllers: str, mountinfo: str | None = None) -> Path | None:
    """Where this process sees the cgroup hierarchy of a ``/proc/<pid>/cgroup`` line mounted.

    Args:
        controllers: The line's middle field: ``""`` for cgroup v2 (``0::``), the v1 hierarchy's
            controllers otherwise (``cpu,cpuacct``, ``name=systemd``).
        mountinfo: ``/proc/self/mountinfo``'s text (default: read it).

    Returns:
        The mount point of that hierarchy's root, or None if it is not mounted (or
        ``/proc/self/mountinfo`` cannot be read).
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    wanted = set(controllers.split(",")) if controllers else None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if not sep or len(fields) < 5 or len(tail) < 3 or fields[3] != "/":
            continue  # a bind mount of a subfolder is not the hierarchy's root
        if (wanted is None and tail[0] == "cgroup2") or (
            wanted is not None and tail[0] == "cgroup" and wanted <= set(tail[2].split(","))
        ):
            return Path(re.sub(r"\\([0-7]{3})", lambda o: chr(int(o[1], 8)), fields[4]))
    return None


def _read_cgroup(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""


def _pid_namespace(pid: int | str) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``/proc/<pid>/ns/pid``: equal for processes in one pid namespace."""
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError as err:
        raise ConfigError(f"pid {pid}'s pid namespace cannot be read: {err.strerror}") from None
    return st.st_dev, st.st_ino


def _under(root: Path) -> Callable[[str], Path]:
    """A fixed cgroup filesystem: v2 at ``root``, each v1 hierarchy at ``root/<controllers>``."""
    return lambda controllers: root / controllers.replace("name=", "") if controllers else root


class KubernetesGrants:
    """The pod-resources grant source (see the module docstring and docs/agent.md §3).

    Args:
        pod_resources_socket: The kubelet's pod-resources socket.
        cri_socket: The container runtime's CRI socket (containerd, CRI-O).
        resources: Which extended resources are devices for the agent.
        cgroup_of: ``pid -> /proc/<pid>/cgroup text`` (tests give their own).
        cgroup_fs: Where the cgroup hierarchies are mounted, to check who owns a pod's folders:
            ``controllers -> mount point`` (``""`` for cgroup v2; default: read from
            ``/proc/self/mountinfo``), or a folder holding v2 at itself and each v1 hierarchy at
            ``<folder>/<controllers>`` (tests).

    Raises:
        BackendUnavailableError: ``grpcio`` is not installed (the ``kubernetes`` extra).
    """

    def __init__(
        self,
        pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET,
        cri_socket: Path = DEFAULT_CRI_SOCKET,
        *,
        resources: tuple[str, ...] = GPU_RESOURCES,
        cgroup_of: Callable[[int], str] = _read_cgroup,
        cgroup_fs: Callable[[str], Path | None] | Path | str = cgroup_mount,
    ) -> None:
        try:
            import grpc  # noqa: PLC0415 - an optional extra, imported only when asked for
        except ImportError:
            raise BackendUnavailableError(
                "Kubernetes grants need grpcio: pip install 'powerlib[kubernetes]'"
            ) from None
        self._grpc = grpc
        self.pod_resources_socket = Path(pod_resources_socket)
        self.cri_socket = Path(cri_socket)
        self.resources = tuple(resources)
        self._cgroup_of = cgroup_of
        self._cgroup_fs = (
            _under(Path(cgroup_fs)) if isinstance(cgroup_fs, str | Path) else cgroup_fs
        )
        self._pods: tuple[float, dict[tuple[str, str, str], tuple[str, ...]]] | None = None
        self._verdicts: dict[
            tuple[str, tuple[int, int]], tuple[float, PodDevices | ConfigError]
        ] = {}
        """Recent placements by (cgroup text, pid namespace): two processes that share both are
        in the same container, so one runtime question answers for both, refusals included."""

    def in_pod(self, pid: int) -> bool:
        """Whether the process runs in a pod (then only the pod's verdict counts for it).

        True for a cgroup in one of the kubelet's layouts anchored at the cgroup root, and, to
        fail closed, for one that cannot be read or placed (see :func:`_place`). A path that
        merely mentions ``kubepods`` deeper down is a host process's.
        """
        placed = _place(self._cgroup_of(pid))
        return placed.problem is not None or placed.pod_uid is not None

    def is_host_process(self, pid: int) -> bool:
        """Whether ``pid`` runs in the agent's own pid namespace (fails closed: False when unread).

        A uid 0 process is admitted as the host's root only then: a container whose cgroup is
        not where this agent looks (a kubelet with a ``--cgroup-root`` of its own, another
        runtime) still runs in a pid namespace of its own, and its root is not the host's.
        """
        try:
            return _pid_namespace(pid) == _pid_namespace("self")
        except ConfigError:
            return False

    def pod_of(self, pid: int) -> str | None:
        """The pod UID of the process's cgroup, ``"?"`` if it cannot be placed, None for the host.

        Cheap (no call to the runtime or the kubelet), for limits per pod; it does not admit.
        """
        placed = _place(self._cgroup_of(pid))
        return "?" if placed.problem is not None else placed.pod_uid

    def pod_granted(self, pid: int) -> bool:
        """Whether the kubelet gave any container of ``pid``'s pod a device (False: a host's).

        The pod's standing for the agent's limits (docs/agent.md §5), whichever container asks:
        a pod is judged by its GPU container, not by a sidecar that connected first. Only the
        pod's identity is checked (:meth:`_identify`); :meth:`devices_of` admits to a device.

        Raises:
            ConfigError: The process cannot be placed or its pod confirmed (the message says why).
        """
        placed = _place(self._cgroup_of(pid))
        if placed.problem is not None:
            raise ConfigError(f"pid {pid}'s cgroup {placed.problem}")
        if placed.pod_uid is None or placed.container_id is None:
            return False
        _, pod_namespace, pod_name, _ = self._identify(placed)
        pods = self._allocations().items()
        return any(ids for (ns, pod, _), ids in pods if (ns, pod) == (pod_namespace, pod_name))

    def devices_of(self, pid: int) -> PodDevices | None:
        """The devices the kubelet allocated to this process's container (None: not in a pod).

        Raises:
            ConfigError: The process cannot be placed: its cgroup cannot be read or names no known
                layout or several containers, a cgroup folder is not root's alone, the runtime
                does not know the container as a running one of that pod, the process is not in
                the container's pid namespace, or a service cannot be reached (the message says
                which).
        """
        text = self._cgroup_of(pid)
        placed = _place(text)
        if placed.problem is not None:
            raise ConfigError(f"pid {pid}'s cgroup {placed.problem}")
        if placed.pod_uid is None or placed.container_id is None:
            return None
        key = (text, _pid_namespace(pid))
        now = time.monotonic()
        cached = self._verdicts.get(key)
        if cached is not None and now - cached[0] < _VERDICT_S:
            if isinstance(cached[1], ConfigError):
                raise ConfigError(cached[1].message)
            return cached[1]
        try:
            found: PodDevices | ConfigError = self._place_container(pid, placed)
        except ConfigError as err:
            found = err
        if len(self._verdicts) > 4096:
            self._verdicts.clear()
        self._verdicts[key] = (now, found)
        if isinstance(found, ConfigError):
            raise found
        return found

    def _place_container(self, pid: int, placed: _Placement) -> PodDevices:
        """:meth:`devices_of` for a process the cgroup places in a container: the checks."""
        status, namespace, name, container = self._identify(placed)
        if status.state != _CONTAINER_RUNNING:
            short = status.container_id[:12]
            raise ConfigError(f"the container runtime reports container {short} is not running")
        self._check_peer(pid, placed, status)
        devices = self._allocations().get((namespace, name, container), ())
        return PodDevices(rule=f"pod:{namespace}/{name}/{container}", devices=devices)

    def _identify(self, placed: _Placement) -> tuple[_Status, str, str, str]:
        """Its runtime status and ``(namespace, pod, container)``, folders and pod UID checked."""
        assert placed.pod_uid is not None and placed.container_id is not None
        pod_uid, container_id = placed.pod_uid, placed.container_id
        self._check_folders(placed)
        status = self._status(container_id)
        short = container_id[:12]
        if status.container_id != container_id:
            raise ConfigError(f"the container runtime answered for another container than {short}")
        labels = status.labels
        name = labels.get("io.kubernetes.pod.name")
        namespace = labels.get("io.kubernetes.pod.namespace")
        container = labels.get("io.kubernetes.container.name")
        if not (name and namespace and container):
            raise ConfigError(f"the container runtime has no pod labels for container {short}")
        if labels.get("io.kubernetes.pod.uid") != pod_uid:
            raise ConfigError(
                f"container {short}: the runtime's pod UID does not match its cgroup's"
            )
        return status, namespace, name, container

    # -- the checks -------------------------------------------------------------------------------

    def _check_folders(self, placed: _Placement) -> None:
        """Every cgroup folder from ``kubepods`` down to the container's is root's alone.

        Only root (the kubelet, the runtime) can then have made them or put a process there; a
        folder a user was delegated, or one made writable, is not the kubelet's.
        """
        for controllers, folder in placed.folders:
            mount = self._cgroup_fs(controllers)
            hierarchy = f"cgroup v1 {controllers}" if controllers else "cgroup v2"
            if mount is None:
                raise ConfigError(f"{hierarchy} is not mounted here, so {folder} cannot be checked")
            where = Path(mount)
            for part in folder.strip("/").split("/"):
                where = where / part
                try:
                    st = os.lstat(where)
                except OSError as err:
                    raise ConfigError(
                        f"cgroup folder {where} cannot be checked: {err.strerror}"
                    ) from None
                if not stat.S_ISDIR(st.st_mode):
                    raise ConfigError(f"cgroup folder {where} is not a folder (a link?)")
                if st.st_uid != 0 or st.st_mode & 0o022:
                    raise ConfigError(
                        f"cgroup folder {where} is owned by uid {st.st_uid} with mode "
                        f"{stat.S_IMODE(st.st_mode):04o}: the kubelet's are root's alone"
                    )

    def _check_peer(self, pid: int, placed: _Placement, status: _Status) -> None:
        """The client is that container's process (docs/agent.md §3, Kubernetes, link 2).

        It must share the pid namespace of the container's init as the runtime reports it; in the
        host's pid namespace (``hostPID``) the init must also be in the client's container cgroup.
        """
        short = status.container_id[:12]
        if status.pid is None:
            raise ConfigError(f"the container runtime gives no pid for container {short}")
        container_ns = _pid_namespace(status.pid)
        if _pid_namespace(pid) != container_ns:
            raise ConfigError(
                f"pid {pid} is not in container {short}'s pid namespace (its init: pid "
                f"{status.pid})"
            )
        if container_ns != _pid_namespace("self"):
            return
        init = _place(self._cgroup_of(status.pid))
        if (init.problem, init.pod_uid, init.container_id) != (
            None,
            placed.pod_uid,
            placed.container_id,
        ):
            raise ConfigError(
                f"container {short} shares the host's pid namespace and its init (pid "
                f"{status.pid}) is not in its cgroup"
            )

    # -- the two services ------------------------------------------------------------------------

    def _call(self, socket_path: Path, method: str, request: bytes, what: str) -> bytes:
        grpc = self._grpc
        try:
            with grpc.insecure_channel(f"unix://{socket_path}") as channel:
                call = channel.unary_unary(
                    method, request_serializer=None, response_deserializer=None
                )
                return bytes(call(request, timeout=_TIMEOUT_S))
        except grpc.RpcError as err:
            raise ConfigError(
                f"{what} at {socket_path}: {err.code().name} {err.details()}"
            ) from None

    def _status(self, container_id: str) -> _Status:
        """The runtime's verbose ``ContainerStatus`` (asked each time: state and pid change)."""
        # ContainerStatusRequest{container_id = 1, verbose = 2}
        request = _field(1, container_id.encode()) + _varint(2 << 3) + _varint(1)
        reply = self._call(
            self.cri_socket, _CONTAINER_STATUS, request, "the container runtime (CRI)"
        )
        status: bytes | None = None
        info: dict[str, str] = {}
        for num, value in _fields(reply):  # ContainerStatusResponse
            if num == 1 and isinstance(value, bytes):  # status
                status = value
            elif num == 2 and isinstance(value, bytes):  # info (map entries)
                key, text = _map_entry(value)
                info[key] = text
        if status is None:
            raise ConfigError(f"the container runtime does not know container {container_id[:12]}")
        state = 0  # CONTAINER_CREATED, the default a message leaves out
        labels: dict[str, str] = {}
        for num, value in _fields(status):  # ContainerStatus
            if num == 3 and isinstance(value, int):  # state
                state = value
            elif num == 12 and isinstance(value, bytes):  # labels (map entries)
                key, text = _map_entry(value)
                labels[key] = text
        return _Status(_text(status, 1), state, labels, _info_pid(info.get("info", "")))

    def _allocations(self) -> dict[tuple[str, str, str], tuple[str, ...]]:
        """``(namespace, pod, container) -> device ids`` from the kubelet (cached a few seconds)."""
        now = time.monotonic()
        if self._pods is not None and now - self._pods[0] < _CACHE_S:
            return self._pods[1]
        reply = self._call(
            self.pod_resources_socket, _LIST_PODS, b"", "the kubelet's pod-resources API"
        )
        out: dict[tuple[str, str, str], tuple[str, ...]] = {}
        for pod in _messages(reply, 1):  # ListPodResourcesResponse.pod_resources
            pod_name, namespace = _text(pod, 1), _text(pod, 2)
            for container in _messages(pod, 3):  # PodResources.containers
                ids: list[str] = []
                for dev in _messages(container, 2):  # ContainerResources.devices
                    if _text(dev, 1) in self.resources:  # ContainerDevices.resource_name
                        ids += [
                            v.decode() for n, v in _fields(dev) if n == 2 and isinstance(v, bytes)
                        ]
                out[(namespace, pod_name, _text(container, 1))] = tuple(ids)
        self._pods = (now, out)
        return out

    def invalidate(self) -> None:
        """Forget the cached allocations and placements (a new pod was scheduled; tests)."""
        self._pods = None
        self._verdicts.clear()


# -- the protobuf wire format, as far as these messages need it ------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    """A length-delimited field (strings, bytes, messages)."""
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ConfigError("a malformed protobuf reply (varint)")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """``(field number, value)`` pairs of one message.

    Bytes for length-delimited fields, ints for varints; fixed-width fields are skipped. A
    malformed message raises ConfigError.
    """
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            yield num, value
        elif wire == 2:
            size, i = _read_varint(data, i)
            if i + size > len(data):
                raise ConfigError("a malformed protobuf reply (length)")
            yield num, data[i : i + size]
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ConfigError(f"a malformed protobuf reply (wire type {wire})")


def _messages(data: bytes, num: int) -> Iterator[bytes]:
    return (v for n, v in _fields(data) if n == num and isinstance(v, bytes))


def _text(data: bytes, num: int) -> str:
    for n, v in _fields(data):
        if n == num and isinstance(v, bytes):
            return v.decode("utf-8", errors="replace")
    return ""


def _map_entry(entry: bytes) -> tuple[str, str]:
    return _text(entry, 1), _text(entry, 2)


def _info_pid(text: str) -> int | None:
    """The container init's host pid from a verbose ``ContainerStatus``'s info, or None.

    containerd and CRI-O both put it under ``"pid"`` in the JSON of the info key ``"info"``.
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    pid = data.get("pid") if isinstance(data, dict) else None
    return pid if type(pid) is int and pid > 0 else None
