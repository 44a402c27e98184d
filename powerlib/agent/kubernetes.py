"""Kubernetes grants: a pod's client may control the GPUs the kubelet gave that pod's container.

The chain of trust, each link from something the client cannot forge (docs/agent.md §3):

1. **Which container.** The client's pid comes from the kernel (``SO_PEERCRED``); its cgroup
   (``/proc/<pid>/cgroup``, kernel-kept, and a process cannot move itself into another pod's
   cgroup) names the pod's UID and the container's id, in every layout kubelet and the runtimes
   use: systemd (``kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``, ``crio-``,
   ``docker-``) and cgroupfs (``/kubepods/burstable/pod<uid>/<id>``).
2. **Which pod.** The container runtime (CRI ``RuntimeService.ListContainers``, filtered by that
   id) gives the container's labels: pod name, namespace, UID and container name. The UID must
   match the cgroup's.
3. **Which devices.** The kubelet's pod-resources API (``PodResourcesLister.List``) gives the
   device ids each container was allocated (``nvidia.com/gpu``: GPU UUIDs; AMD: PCI bus ids),
   which the agent resolves like any other id form.

A client outside every pod (a host process) gets nothing from here; one inside a pod gets only
its container's devices, even as uid 0 (a container's root is the host's root without user
namespaces, so the agent does not admit it as root). Both services are gRPC on Unix sockets;
``grpcio`` (the ``kubernetes`` extra) carries the calls and this module reads and writes the few
protobuf fields it needs itself.
"""

from __future__ import annotations

import re
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
    "container_of_cgroup",
]

DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
DEFAULT_CRI_SOCKET = Path("/run/containerd/containerd.sock")
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
_LIST_PODS = "/v1.PodResourcesLister/List"
_LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER = re.compile(
    r"^(?:cri-containerd-|crio-|docker-|containerd-)?([0-9a-f]{64})(?:\.scope)?$"
)
_TIMEOUT_S = 5.0
_CACHE_S = 5.0


@dataclass(frozen=True, slots=True)
class PodDevices:
    """What the kubelet allocated to one client's container.

    Attributes:
        rule: How refusals and leases name it: ``pod:<namespace>/<pod>/<container>``.
        devices: The device ids the kubelet reported (UUIDs or PCI bus ids).
    """

    rule: str
    devices: tuple[str, ...]


def container_of_cgroup(text: str) -> tuple[str, str] | None:
    """``(pod UID, container id)`` from ``/proc/<pid>/cgroup``'s text, or None if none is named.

    The container's component may be followed by cgroups of its own (systemd inside a container:
    ``.../cri-containerd-<id>.scope/init.scope``); the nearest one below the pod is taken.
    """
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        pod = _POD.search(path)
        if pod is None:
            continue
        below = path[pod.end() :].split("/")
        for part in below:
            container = _CONTAINER.match(part)
            if container is not None:
                return pod.group(1).replace("_", "-"), container.group(1)
    return None


def _kubepods(text: str) -> bool:
    """Whether the cgroup lies under Kubernetes' pods (or cannot be read: then assume so)."""
    return not text.strip() or "kubepods" in text


def _read_cgroup(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""


class KubernetesGrants:
    """The pod-resources grant source (see the module docstring).

    Args:
        pod_resources_socket: The kubelet's pod-resources socket.
        cri_socket: The container runtime's CRI socket (containerd, CRI-O).
        resources: Which extended resources are devices for the agent.
        cgroup_of: ``pid -> /proc/<pid>/cgroup text`` (tests give their own).

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
        self._pods: tuple[float, dict[tuple[str, str, str], tuple[str, ...]]] | None = None
        self._labels_cache: dict[str, dict[str, str]] = {}

    def in_pod(self, pid: int) -> bool:
        """Whether the process may run in a pod (then it is never admitted as root).

        Fails closed: a cgroup under ``kubepods`` in any layout, or one that cannot be read,
        counts as a pod, so an unrecognised layout is refused rather than admitted as root.
        """
        return _kubepods(self._cgroup_of(pid))

    def devices_of(self, pid: int) -> PodDevices | None:
        """The devices the kubelet allocated to this process's container (None: not in a pod).

        Raises:
            ConfigError: The runtime does not know the container, or its pod UID differs from the
                cgroup's, or a service cannot be reached (the message says which).
        """
        text = self._cgroup_of(pid)
        found = container_of_cgroup(text)
        if found is None:
            if _kubepods(text):
                raise ConfigError(f"pid {pid}'s cgroup names no pod and container this agent knows")
            return None
        pod_uid, container_id = found
        labels = self._labels(container_id)
        name = labels.get("io.kubernetes.pod.name")
        namespace = labels.get("io.kubernetes.pod.namespace")
        container = labels.get("io.kubernetes.container.name")
        if not (name and namespace and container):
            raise ConfigError(
                f"the container runtime has no pod labels for container {container_id[:12]}"
            )
        if labels.get("io.kubernetes.pod.uid") != pod_uid:
            raise ConfigError(
                f"container {container_id[:12]}: the runtime's pod UID does not match its cgroup's"
            )
        devices = self._allocations().get((namespace, name, container), ())
        return PodDevices(rule=f"pod:{namespace}/{name}/{container}", devices=devices)

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

    def _labels(self, container_id: str) -> dict[str, str]:
        cached = self._labels_cache.get(container_id)
        if cached is not None:
            return cached
        # ListContainersRequest{filter: ContainerFilter{id}} -> ListContainersResponse{containers}
        request = _field(1, _field(1, container_id.encode()))
        reply = self._call(
            self.cri_socket, _LIST_CONTAINERS, request, "the container runtime (CRI)"
        )
        for num, value in _fields(reply):
            if num != 1 or not isinstance(value, bytes):
                continue
            if _text(value, 1) != container_id:  # Container.id
                continue
            labels: dict[str, str] = {}
            for n, entry in _fields(value):
                if n == 8 and isinstance(entry, bytes):  # Container.labels (map entries)
                    key, text = _map_entry(entry)
                    labels[key] = text
            if len(self._labels_cache) > 4096:
                self._labels_cache.clear()
            self._labels_cache[container_id] = labels  # a container's labels never change
            return labels
        raise ConfigError(f"the container runtime does not know container {container_id[:12]}")

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
        """Forget the cached allocations (a new pod was scheduled; tests)."""
        self._pods = None


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
