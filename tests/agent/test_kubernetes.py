"""Kubernetes grants: a fake kubelet (pod-resources) and a fake container runtime (CRI), both real
gRPC servers on Unix sockets, and clients forked into "pods": their cgroup text is given to the
agent, keyed by pid, as /proc/<pid>/cgroup would show it, over a fake cgroup filesystem (folders
owned by the uids a test picks); the runtime reports each container's init pid. Some pods are
real pid namespaces (a child that unshares one and forks its pid 1), and one test moves a real
process into real, user-delegated cgroups (docs/agent.md §3, Kubernetes).

The protobuf replies are built here with a few lines of encoder of their own, independent of the
decoder under test, from the field numbers of kubelet's pod-resources v1 and CRI runtime v1.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
from test_agent import NOBODY, NOGROUP, _try, open_connections, spawn_as
from test_agent import root_dir as root_dir  # the fixture, shared

from powerlib.agent.authz import Grant, Rules
from powerlib.agent.client import AgentConnection
from powerlib.agent.kubernetes import (
    KubernetesGrants,
    _read_cgroup,
    cgroup_mount,
    container_of_cgroup,
)
from powerlib.agent.transport import Agent
from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings
from powerlib.errors import ConfigError, PowerlibError

grpc = pytest.importorskip("grpc")

POD_UID = "6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f"
CID = "ab" * 32


def cgroup_v2(pod_uid: str, cid: str, runtime: str = "cri-containerd") -> str:
    slice_uid = pod_uid.replace("-", "_")
    return (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{slice_uid}.slice/{runtime}-{cid}.scope\n"
    )


def delegated(uid: int, pod_uid: str, cid: str) -> str:
    """The cgroup a user may make in the user@UID.service systemd delegates to them."""
    return (
        f"0::/user.slice/user-{uid}.slice/user@{uid}.service/app.slice/"
        f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n"
    )


def cgroup_tree(root: Path, text: str) -> None:
    """Make each line's folders on the fake cgroup filesystem at ``root``: root's, mode 0755."""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        where = root / controllers.replace("name=", "") if controllers else root
        for part in path.strip("/").split("/"):
            where = where / part
            where.mkdir(exist_ok=True)
            os.chown(where, 0, 0)
            where.chmod(0o755)


# -- an encoder of our own (not the module's) ------------------------------------------------------


def _v(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def f(num: int, payload: bytes | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else payload
    return _v(num << 3 | 2) + _v(len(data)) + data


def pod_resources(pods: list[tuple[str, str, list[tuple[str, dict[str, list[str]]]]]]) -> bytes:
    """ListPodResourcesResponse from (namespace, pod, [(container, {resource: [ids]})])."""
    out = b""
    for namespace, name, containers in pods:
        body = f(1, name) + f(2, namespace)
        for cname, resources in containers:
            cbody = f(1, cname)
            for resource, ids in resources.items():
                cbody += f(
                    2, f(1, resource) + b"".join(f(2, i) for i in ids) + f(3, f(1, b"\x08\x00"))
                )
            cbody += b"\x18\x05"  # cpu_ids = 5 (a varint field the reader must skip)
            body += f(3, cbody)
        out += f(1, body)
    return out


def containers(items: list[tuple[str, dict[str, str]]]) -> bytes:
    """ListContainersResponse from (id, labels)."""
    out = b""
    for cid, labels in items:
        body = f(1, cid) + f(2, "sandbox") + f(3, f(1, "trainer"))
        body += b"".join(f(8, f(1, k) + f(2, v)) for k, v in labels.items())
        out += f(1, body)
    return out


def labels(pod: str, namespace: str, uid: str, container: str = "trainer") -> dict[str, str]:
    return {
        "io.kubernetes.pod.name": pod,
        "io.kubernetes.pod.namespace": namespace,
        "io.kubernetes.pod.uid": uid,
        "io.kubernetes.container.name": container,
    }


def container_status(cid: str, labels: dict[str, str], state: int, pid: int | None) -> bytes:
    """ContainerStatusResponse{status: ContainerStatus{id, metadata, state, labels}, info}."""
    body = f(1, cid) + f(2, f(1, labels.get("io.kubernetes.container.name", "")))
    body += (_v(3 << 3) + _v(state)) if state else b""  # proto3 leaves the default (0) out
    body += b"".join(f(12, f(1, k) + f(2, v)) for k, v in labels.items())
    out = f(1, body)
    if pid is not None:  # containerd's verbose info: JSON under "info"
        out += f(2, f(1, "info") + f(2, json.dumps({"sandboxID": "sandbox", "pid": pid})))
    return out


class FakeNode:
    """The kubelet's pod-resources service and the runtime's CRI service, on Unix sockets.

    ``containers`` are the runtime's (id, labels); ``init_pids`` the host pid of each one's init
    (what a verbose ContainerStatus reports); ``states`` a state other than running; ``cgroup_fs``
    the fake cgroup filesystem the agent checks folders on.
    """

    def __init__(self, root: Path) -> None:
        self.pod_sock = root / "kubelet.sock"
        self.cri_sock = root / "containerd.sock"
        self.cgroup_fs = root / "cgroup"
        self.cgroup_fs.mkdir(mode=0o755)
        self.pods: list = []
        self.containers: list = []
        self.init_pids: dict[str, int] = {}
        self.states: dict[str, int] = {}
        self.answer_as: str | None = None  # a runtime that answers for another container
        self.cri_requests: list[bytes] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
                "List": grpc.unary_unary_rpc_method_handler(lambda req, ctx: pod_resources(self.pods)),
            }),
            grpc.method_handlers_generic_handler("runtime.v1.RuntimeService", {
                "ListContainers": grpc.unary_unary_rpc_method_handler(self._list_containers),
                "ContainerStatus": grpc.unary_unary_rpc_method_handler(self._container_status),
            }),
        ))  # fmt: skip
        self.server.add_insecure_port(f"unix://{self.pod_sock}")
        self.server.add_insecure_port(f"unix://{self.cri_sock}")
        self.server.start()

    def _list_containers(self, request: bytes, ctx: object) -> bytes:
        self.cri_requests.append(request)
        # the filter's id: ListContainersRequest{1: ContainerFilter{1: id}} (2 + 2 header bytes)
        wanted = request[4:].decode()
        return containers([c for c in self.containers if c[0] == wanted])

    def _container_status(self, request: bytes, ctx: Any) -> bytes:
        self.cri_requests.append(request)
        # ContainerStatusRequest{1: container_id, 2: verbose}: the info comes only when verbose
        size = request[1]
        wanted, verbose = request[2 : 2 + size].decode(), request[2 + size :] == b"\x10\x01"
        for cid, lab in self.containers:
            if cid == wanted:
                pid = self.init_pids.get(cid) if verbose else None
                state = self.states.get(cid, 1)  # CONTAINER_RUNNING
                return container_status(self.answer_as or cid, lab, state, pid)
        ctx.abort(grpc.StatusCode.NOT_FOUND, f"container {wanted!r} not found")
        raise AssertionError("unreachable")

    def stop(self) -> None:
        self.server.stop(grace=None)


@contextlib.contextmanager
def kube_node(
    root_dir: Path,
    *,
    allow: tuple[Grant, ...] = (),
    grants_dir: Path | None = None,
    real_cgroups: bool = False,
) -> Iterator[tuple[FakeNode, Agent, dict[int, str], list[str]]]:
    """An agent with Kubernetes grants over a fake node; ``real_cgroups``: the processes' real
    /proc/<pid>/cgroup and the real cgroup mounts, else the test's text and fake filesystem."""
    node = FakeNode(root_dir)
    cgroups: dict[int, str] = {}
    backend = SimulatedBackend(
        Settings(backend="simulated", sim_gpus=2, state_dir=root_dir / "state")
    )
    uuids = [d.device_id for d in backend.devices()]
    if real_cgroups:
        grants = KubernetesGrants(node.pod_sock, node.cri_sock)
    else:
        grants = KubernetesGrants(
            node.pod_sock,
            node.cri_sock,
            cgroup_of=lambda pid: cgroups.get(pid, "0::/user.slice\n"),
            cgroup_fs=node.cgroup_fs,
        )
    sock = root_dir / "run" / "agent.sock"
    rules = Rules(allow=allow, grants_dir=grants_dir, kubernetes=grants)
    agent = Agent(backend, socket_path=sock, rules=rules, group=NOGROUP)
    try:
        with agent.in_thread():
            yield node, agent, cgroups, uuids
    finally:
        backend.close()
        node.stop()


@pytest.fixture
def kube(root_dir: Path) -> Iterator[tuple[FakeNode, Agent, dict[int, str], list[str]]]:
    with kube_node(root_dir) as k:
        yield k


# -- clients ---------------------------------------------------------------------------------------


class Lines:
    """``key value`` lines a child writes on a pipe, read with a bound on the wait."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer, self.seen = fd, b"", {}

    def wait(self, *keys: str) -> tuple[str, str]:
        """The first of ``keys`` the child wrote, and its value."""
        while not any(k in self.seen for k in keys):
            if b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                k, _, v = line.decode().partition(" ")
                self.seen[k] = v
                continue
            assert select.select([self.fd], [], [], 60)[0], f"no {keys} from the child"
            chunk = os.read(self.fd, 4096)
            assert chunk, f"the child ended without {keys}: {self.seen}"
            self.buffer += chunk
        key = next(k for k in keys if k in self.seen)
        return key, self.seen[key]

    def get(self, key: str) -> str:
        return self.wait(key)[1]


def _byte(fd: int) -> bytes:
    """The next byte the test sends (``g``: go, ``r``: release, ``q``: quit), or b"" after 60 s."""
    return os.read(fd, 1) if select.select([fd], [], [], 60)[0] else b""


def _client(sock: Path, down: int, up: int, op: str, args: dict[str, Any]) -> None:
    """In a child, at its uid: on ``g``, connect and try ``op``; hold the connection until ``r``."""
    if _byte(down) != b"g":
        return
    with AgentConnection(sock) as conn:
        out = _try(lambda: conn.call(op, **args))
        os.write(up, ("result " + out.replace("\n", " ") + "\n").encode())
        _byte(down)


def _states(agent: Agent) -> list[tuple[Any, float | None]]:
    """(locked clocks, power limit) of every device."""
    return [
        (s.locked_sm_freqs_mhz, s.power_limit_w)
        for s in (d.read_state() for d in agent.backend.devices())
    ]


def _defaults(agent: Agent) -> list[tuple[Any, float | None]]:
    return [(None, d.info.default_power_limit_w) for d in agent.backend.devices()]


def _converse(agent: Agent, lines: Lines, down: int) -> tuple[str, list]:
    """Let the client try, then read every device while its connection is still open (a lease
    ends, and is undone, when it closes)."""
    os.write(down, b"g")
    out = lines.get("result")
    states = _states(agent)
    os.write(down, b"r")
    return out, states


def _attempt(
    kube,
    uid: int,
    cgroup: str,
    device: int,
    *,
    op: str = "lock_sm_clocks",
    tree: bool = True,
    as_init: bool = True,
    **args: Any,
) -> tuple[str, list]:
    """A host process forked as ``uid`` whose cgroup reads ``cgroup``: its attempt at ``op`` on
    ``device``, and every device's state while it is still connected.

    ``tree``: make the cgroup's folders on the fake cgroup filesystem (root's); ``as_init``: the
    runtime reports this process as its container's init (a container in the host's pid
    namespace whose first process is the client).
    """
    node, agent, cgroups, _ = kube
    if tree:
        cgroup_tree(node.cgroup_fs, cgroup)
    args = {"device": device, **(args or {"min_mhz": 1005})}
    down, w_down = os.pipe()
    pid, r = spawn_as(uid, lambda w: _client(agent.socket_path, down, w, op, args))
    os.close(down)
    try:
        cgroups[pid] = cgroup
        for cid in re.findall("[0-9a-f]{64}", cgroup) if as_init else ():
            node.init_pids[cid] = pid
        return _converse(agent, Lines(r), w_down)
    finally:
        with contextlib.suppress(OSError):
            os.write(w_down, b"r")
        os.close(w_down)
        os.close(r)
        os.waitpid(pid, 0)


def _in_pod(kube, uid: int, cgroup: str, device: int) -> str:
    """A client forked as ``uid`` whose cgroup is ``cgroup``: its attempt to lock ``device``."""
    return _attempt(kube, uid, cgroup, device)[0]


# A container as a runtime starts one, in a fresh interpreter (a process that has unshared a pid
# namespace may not start threads, which gRPC's fork handlers in this one would try): it unshares
# a pid namespace and forks its pid 1, the container's init; with a worker, the init forks it, at
# the worker's uid, inside the namespace. argv: uid, up fd, down fd, quit fd, worker JSON or "".
_POD = r"""
import ctypes, json, os, select, sys
from powerlib.agent.client import AgentConnection  # before the uid drop: it may not read them
from powerlib.errors import PowerlibError
uid, up, down, quit_fd = map(int, sys.argv[1:5])
worker = json.loads(sys.argv[5]) if sys.argv[5] else None
def byte(fd):
    return os.read(fd, 1) if select.select([fd], [], [], 60)[0] else b""
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:  # CLONE_NEWPID
    os.write(up, f"unshare {ctypes.get_errno()}\n".encode())
    sys.exit(0)
init = os.fork()
if init == 0:  # pid 1 of the new namespace; its end ends every process in it
    if worker is not None and os.fork() == 0:
        os.setgroups([]); os.setgid(65534); os.setuid(uid)
        os.write(up, f"worker {os.readlink('/proc/self')}\n".encode())  # its host pid
        if byte(down) == b"g":
            with AgentConnection(worker["sock"]) as conn:
                try:
                    conn.call(worker["op"], **worker["args"])
                    out = "ok"
                except PowerlibError as err:
                    out = type(err).__name__ + ": " + err.message
                os.write(up, ("result " + out.replace("\n", " ") + "\n").encode())
                byte(down)
        os._exit(0)
    byte(quit_fd)
    os._exit(0)
os.write(up, f"init {init}\n".encode())
os.waitpid(init, 0)
"""


class PidNamespacePod:
    """A container in a pid namespace of its own (see ``_POD``): ``init_pid`` is its pid 1's host
    pid; with ``worker`` (``{"sock", "op", "args"}``) a process of the container at ``uid``
    (host pid ``worker_pid``) connects on ``g`` and holds its connection until ``r`` (sent on
    ``down_w``). Skips the test if pid namespaces are not permitted here (EPERM)."""

    def __init__(self, uid: int, worker: dict[str, Any] | None = None) -> None:
        up_r, up = os.pipe()
        self.quit_r, self.quit_w = os.pipe()
        self.down, self.down_w = os.pipe()
        spec = json.dumps(worker) if worker is not None else ""
        argv = [sys.executable, "-c", _POD, str(uid), str(up), str(self.down), str(self.quit_r)]
        self.proc = subprocess.Popen([*argv, spec], pass_fds=(up, self.down, self.quit_r))
        os.close(up)
        self.lines = Lines(up_r)
        self.init_pid = self.worker_pid = 0
        try:
            key, value = self.lines.wait("init", "unshare")
            if key == "unshare":
                if int(value) == errno.EPERM:
                    pytest.skip("unshare(CLONE_NEWPID) is not permitted here (EPERM)")
                raise AssertionError(f"unshare(CLONE_NEWPID) failed: errno {value}")
            self.init_pid = int(value)
            if worker is not None:
                self.worker_pid = int(self.lines.get("worker"))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the worker, end the init (and with it the namespace), wait for them."""
        for fd, byte in ((self.down_w, b"r"), (self.quit_w, b"q")):
            with contextlib.suppress(OSError):
                os.write(fd, byte)
        self.proc.wait(timeout=60)
        for fd in (self.lines.fd, self.quit_r, self.quit_w, self.down, self.down_w):
            os.close(fd)


def test_a_pod_controls_the_gpus_the_kubelet_gave_its_container_and_no_other(kube) -> None:
    node, agent, _, uuids = kube
    node.containers = [(CID, labels("train-0", "ml", POD_UID))]
    node.pods = [
        ("ml", "train-0", [("trainer", {"nvidia.com/gpu": [uuids[1]], "example.com/nic": ["x"]})]),
        ("ml", "other", [("trainer", {"nvidia.com/gpu": [uuids[0]]})]),
    ]
    assert _in_pod(kube, NOBODY, cgroup_v2(POD_UID, CID), 1) == "ok"
    refused = _in_pod(kube, NOBODY, cgroup_v2(POD_UID, CID), 0)
    assert refused.startswith(f"PermissionDeniedError: uid {NOBODY} may not control device 0")
    assert f"pod:ml/train-0/trainer was allocated {uuids[1]} by the kubelet" in refused
    assert node.cri_requests  # the runtime was asked, by container id


def test_a_containers_root_is_not_the_hosts_root(kube) -> None:
    node, _, _, uuids = kube
    node.containers = [(CID, labels("notebook", "ml", POD_UID))]
    node.pods = [("ml", "notebook", [("trainer", {})])]
    refused = _in_pod(kube, 0, cgroup_v2(POD_UID, CID, "crio"), 0)
    assert refused.startswith("PermissionDeniedError: uid 0 may not control device 0")
    assert "pod:ml/notebook/trainer was allocated no GPUs" in refused
    with AgentConnection(kube[1].socket_path) as conn:  # the host's root (this test) still is
        assert conn.call("lock_sm_clocks", device=0, min_mhz=1005) == [1005.0, 1005.0]


def test_a_pod_uid_that_does_not_match_the_cgroup_is_refused(kube) -> None:
    node, _, _, uuids = kube
    node.containers = [(CID, labels("train-0", "ml", "00000000-0000-0000-0000-000000000000"))]
    node.pods = [("ml", "train-0", [("trainer", {"nvidia.com/gpu": [uuids[0]]})])]
    refused = _in_pod(kube, NOBODY, cgroup_v2(POD_UID, CID), 0)
    assert "cannot tell which pod it runs in" in refused and "does not match" in refused


def test_an_unreachable_runtime_refuses_with_the_reason(kube) -> None:
    node, _, _, _ = kube
    node.stop()
    refused = _in_pod(kube, NOBODY, cgroup_v2(POD_UID, CID), 0)
    assert "cannot tell which pod it runs in" in refused and "container runtime (CRI)" in refused


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        (cgroup_v2(POD_UID, CID), (POD_UID, CID)),
        (cgroup_v2(POD_UID, CID, "crio"), (POD_UID, CID)),
        (cgroup_v2(POD_UID, CID, "docker"), (POD_UID, CID)),
        (
            f"12:devices:/kubepods/burstable/pod{POD_UID}/{CID}\n11:cpu:/kubepods/burstable/pod{POD_UID}/{CID}\n",
            (POD_UID, CID),
        ),
        (
            f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
            (POD_UID, CID),
        ),
        (cgroup_v2(POD_UID, CID).rstrip() + "/init.scope\n", (POD_UID, CID)),  # systemd inside
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),  # a host process
        (
            f"0::/kubepods.slice/kubepods-pod{POD_UID.replace('-', '_')}.slice\n",
            None,
        ),  # no container
        (f"0::/kubepods/pod{POD_UID}/{'zz' * 32}\n", None),  # not a container id
        (delegated(1000, POD_UID, CID), None),  # a user's delegated cgroup: the host's
        (f"0::/system.slice/x.service{cgroup_v2(POD_UID, CID)[3:]}", None),  # not at the root
        (f"0::/kubepods/besteffort/pod{'0f' * 16}/{CID}\n", ("0f" * 16, CID)),  # a static pod
        (cgroup_v2(POD_UID, CID).replace("burstable-pod", "besteffort-pod"), None),  # qos differs
        (f"0::/kubepods/pod{POD_UID.replace('-', '_')}/{CID}\n", None),  # systemd's uid spelling
        (f"4:cpu:/kubepods/pod{POD_UID}/{CID}\n0::/kubepods/pod{POD_UID}/{'cd' * 32}\n", None),
        (f"4:cpu:/kubepods/pod{POD_UID}/{CID}\n0::/init.scope\n", (POD_UID, CID)),  # hybrid
    ],
)
def test_the_cgroup_names_the_pod_and_the_container(text: str, expect) -> None:
    assert container_of_cgroup(text) == expect


def test_malformed_replies_are_one_clear_error(tmp_path: Path) -> None:
    grants = KubernetesGrants(tmp_path / "k.sock", tmp_path / "c.sock")
    grants._call = lambda *a: b"\x0a\xff\xff\xff\xff\x0f"  # a length past the end
    with pytest.raises(ConfigError, match="malformed protobuf"):
        grants._allocations()
    grants._call = lambda *a: b"\x0b"  # wire type 3 (groups): not in these messages
    grants.invalidate()
    with pytest.raises(ConfigError, match="malformed protobuf"):
        grants._allocations()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="the kubelet's pod-resources API"):
        KubernetesGrants(tmp_path / "none.sock", tmp_path / "c.sock")._allocations()
    assert time.monotonic() - started < 30  # bounded by the call's own timeout


def test_an_unrecognised_pod_cgroup_or_an_unreadable_one_fails_closed(kube) -> None:
    """A uid 0 process the agent cannot place is refused, never admitted as the host's root."""
    slice_uid = POD_UID.replace("-", "_")
    odd = f"0::/kubepods.slice/kubepods-pod{slice_uid}.slice/something-else\n"
    refused = _in_pod(kube, 0, odd, 0)
    assert refused.startswith("PermissionDeniedError") and "names no pod and container" in refused
    refused = _in_pod(kube, 0, "", 0)  # /proc/<pid>/cgroup unreadable
    assert refused.startswith("PermissionDeniedError")


# -- the attacks of issue 31 (point 2 and point 3's last sentence) --------------------------------


def _victim(kube) -> None:
    """A pod ``ml/train-0`` whose container CID the kubelet gave GPU 0."""
    node, _, _, uuids = kube
    node.containers = [(CID, labels("train-0", "ml", POD_UID))]
    node.pods = [("ml", "train-0", [("trainer", {"nvidia.com/gpu": [uuids[0]]})])]


def test_a_users_delegated_cgroup_named_like_a_pod_is_a_host_process(kube) -> None:
    """A user makes user@UID.service/app.slice/kubepods-…-pod<victim>.slice/cri-containerd-
    <victim's container>.scope in the cgroup systemd delegates to them: not a pod, even with the
    runtime naming the attacker as that container's init; nobody has no grant of its own."""
    node, agent, _, _ = kube
    _victim(kube)
    out, states = _attempt(kube, NOBODY, delegated(NOBODY, POD_UID, CID), 0)
    assert out == (
        f"PermissionDeniedError: uid {NOBODY} may not control device 0 ({kube[3][0]}): no "
        f"allow-list rule or job grant names uid {NOBODY} (default deny)"
    )
    assert states == _defaults(agent)


@pytest.mark.parametrize("how", ["pod owned", "container owned", "container linked", "writable"])
def test_pod_cgroup_folders_an_attacker_owns_are_not_the_kubelets(kube, how: str) -> None:
    """The anchored layout, the runtime's labels and init all match; only the folders differ."""
    node, agent, _, _ = kube
    _victim(kube)
    text = cgroup_v2(POD_UID, CID)
    cgroup_tree(node.cgroup_fs, text)
    container = node.cgroup_fs / text.split("::/", 1)[1].strip()
    pod = container.parent
    if how == "pod owned":
        os.chown(pod, NOBODY, NOGROUP)
    elif how == "container owned":
        os.chown(container, NOBODY, NOGROUP)
    elif how == "container linked":
        own = node.cgroup_fs / "elsewhere"
        own.mkdir()
        os.chown(own, NOBODY, NOGROUP)
        container.rmdir()
        container.symlink_to(own)
    else:
        pod.chmod(0o777)
    out, states = _attempt(kube, NOBODY, text, 0, tree=False)
    assert out.startswith(f"PermissionDeniedError: uid {NOBODY} pid ") and "cgroup folder" in out
    assert ("not a folder" if how == "container linked" else "root's alone") in out
    assert states == _defaults(agent)


def test_a_host_process_outside_the_containers_pid_namespace_is_refused(kube) -> None:
    """The victim's container is a real pid namespace; the attacker, a plain host process, shows
    the victim's cgroup (anchored, root's folders): the runtime's init is not in its namespace."""
    node, agent, _, _ = kube
    _victim(kube)
    pod = PidNamespacePod(NOBODY)
    try:
        node.init_pids[CID] = pod.init_pid
        out, states = _attempt(kube, NOBODY, cgroup_v2(POD_UID, CID), 0, as_init=False)
    finally:
        pod.close()
    assert out.startswith(f"PermissionDeniedError: uid {NOBODY} pid ")
    assert f"is not in container {CID[:12]}'s pid namespace (its init: pid {pod.init_pid})" in out
    assert states == _defaults(agent)


def test_a_process_in_the_containers_pid_namespace_gets_its_gpu(kube) -> None:
    """A real pid namespace: the runtime reports its pid 1; a process of the container (not the
    init) asks for the GPU the kubelet gave the container, and gets it."""
    node, agent, cgroups, uuids = kube
    _victim(kube)
    text = cgroup_v2(POD_UID, CID)
    cgroup_tree(node.cgroup_fs, text)
    args = {"device": 0, "min_mhz": 1005}
    pod = PidNamespacePod(
        NOBODY, {"sock": str(agent.socket_path), "op": "lock_sm_clocks", "args": args}
    )
    try:
        assert pod.worker_pid != pod.init_pid
        cgroups[pod.worker_pid] = text
        node.init_pids[CID] = pod.init_pid
        out, states = _converse(agent, pod.lines, pod.down_w)
    finally:
        pod.close()
    assert out == "ok"
    assert states[0] != _defaults(agent)[0] and states[1] == _defaults(agent)[1]


def test_a_host_pid_container_needs_its_init_in_its_cgroup(kube) -> None:
    """hostPID: the namespace check says nothing, so the runtime's init must sit in the client's
    container cgroup; here the runtime names a host process (this test) as the init."""
    node, agent, _, _ = kube
    _victim(kube)
    node.init_pids[CID] = os.getpid()
    out, states = _attempt(kube, NOBODY, cgroup_v2(POD_UID, CID), 0, as_init=False)
    assert out.startswith(f"PermissionDeniedError: uid {NOBODY} pid ")
    assert "shares the host's pid namespace and its init" in out
    assert states == _defaults(agent)


@pytest.mark.parametrize("problem", ["exited", "another id", "no pid"])
def test_the_runtime_must_report_that_container_running_with_its_init(kube, problem) -> None:
    node, agent, _, _ = kube
    _victim(kube)
    if problem == "exited":
        node.states[CID] = 2  # CONTAINER_EXITED
    elif problem == "another id":
        node.answer_as = "cd" * 32
    out, states = _attempt(kube, NOBODY, cgroup_v2(POD_UID, CID), 0, as_init=problem != "no pid")
    assert out.startswith(f"PermissionDeniedError: uid {NOBODY} pid ")
    assert {
        "exited": "is not running",
        "another id": "answered for another container",
        "no pid": "gives no pid",
    }[problem] in out
    assert states == _defaults(agent)


def test_in_a_pod_only_the_pods_verdict_counts(root_dir: Path) -> None:
    """A pod with no GPU: its root is refused though the allow list and a job grant name uid 0
    for every device; its nobody is refused 150 W on GPU 0 though the allow list gives nobody
    every device. The host's root (this test) is still admitted."""
    grants = root_dir / "grants"
    grants.mkdir(mode=0o755)
    (grants / "job-x.json").write_text(json.dumps({"job": "x", "uid": 0, "devices": ["*"]}))
    (grants / "job-x.json").chmod(0o644)
    allow = (
        Grant(rule="allow:root", uid=0, gid=None, devices=("*",)),
        Grant(rule="allow:nobody", uid=NOBODY, gid=None, devices=("*",)),
    )
    with kube_node(root_dir, allow=allow, grants_dir=grants) as kube:
        node, agent, _, _ = kube
        node.containers = [(CID, labels("notebook", "ml", POD_UID))]
        node.pods = [("ml", "notebook", [("trainer", {})])]
        text = cgroup_v2(POD_UID, CID)
        out, states = _attempt(kube, 0, text, 0)
        assert out == (
            f"PermissionDeniedError: uid 0 may not control device 0 ({kube[3][0]}): "
            "pod:ml/notebook/trainer was allocated no GPUs by the kubelet"
        )
        assert states == _defaults(agent)
        out, states = _attempt(kube, NOBODY, text, 0, op="set_power_limit", power_limit_w=150)
        assert out.startswith(f"PermissionDeniedError: uid {NOBODY} may not control device 0")
        assert "pod:ml/notebook/trainer was allocated no GPUs" in out
        assert states[0] == (None, agent.backend.devices()[0].info.default_power_limit_w)
        with AgentConnection(agent.socket_path) as conn:
            assert conn.call("set_power_limit", device=0, power_limit_w=150) is not None


def test_a_real_delegated_cgroup_named_like_a_pod_is_a_host_process(root_dir: Path) -> None:
    """The attack of issue 31 with real cgroups: root puts nobody in its user@65534.service
    (delegated as systemd does: the folder and its cgroup.procs are nobody's); nobody makes
    app.slice/kubepods-burstable-pod<victim>.slice/cri-containerd-<victim's id>.scope there,
    moves itself in and asks for the victim's GPU. The agent reads the real cgroup."""
    mount = cgroup_mount("")
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy is mounted here")
    base = mount / f"powerlib-test-{uuid.uuid4().hex[:12]}"
    try:
        base.mkdir()
    except OSError as err:
        pytest.skip(f"cgroup v2 at {mount} is not writable here: {err.strerror}")
    user = base / "user.slice" / f"user-{NOBODY}.slice" / f"user@{NOBODY}.service"
    leaf = (
        user / "app.slice" / f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
        / f"cri-containerd-{CID}.scope"
    )  # fmt: skip
    pid = None
    try:
        user.mkdir(parents=True)
        for path in (user, user / "cgroup.procs", user / "cgroup.subtree_control"):
            os.chown(path, NOBODY, NOGROUP)
        with kube_node(root_dir, real_cgroups=True) as kube:
            node, agent, _, _ = kube
            _victim(kube)
            args = {"device": 0, "min_mhz": 1005}
            down, w_down = os.pipe()

            def attacker(up: int) -> None:
                if _byte(down) != b"p":  # placed in its user@.service by root
                    return
                leaf.mkdir(parents=True)
                (leaf / "cgroup.procs").write_text("0")
                os.write(up, b"moved\n")
                _client(agent.socket_path, down, up, "lock_sm_clocks", args)

            pid, r = spawn_as(NOBODY, attacker)
            (user / "cgroup.procs").write_text(str(pid))
            os.write(w_down, b"p")
            lines = Lines(r)
            lines.get("moved")
            node.init_pids[CID] = pid  # even named by the runtime as the container's init
            assert f"kubepods-burstable-pod{POD_UID.replace('-', '_')}" in _read_cgroup(pid)
            out, states = _converse(agent, lines, w_down)
            os.waitpid(pid, 0)
            pid = None
            os.close(r)
            os.close(w_down)
            os.close(down)
            assert out.startswith(f"PermissionDeniedError: uid {NOBODY} may not control device")
            assert "default deny" in out
            assert states == _defaults(agent)
    finally:
        if pid is not None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        for folder in sorted((p for p in base.rglob("*") if p.is_dir()), key=str, reverse=True):
            folder.rmdir()
        base.rmdir()


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("0::/user.slice/user-1000.slice/session-3.scope\n", (False, None)),
        (delegated(1000, POD_UID, CID), (False, None)),
        (cgroup_v2(POD_UID, CID), (True, POD_UID)),
        ("", (True, "?")),  # unreadable
        (  # hybrid: the v1 lines and the v2 line name different containers
            f"4:cpu:/kubepods/pod{POD_UID}/{CID}\n0::/kubepods/pod{POD_UID}/{'cd' * 32}\n",
            (True, "?"),
        ),
        (f"4:cpu:/kubepods/pod{POD_UID}/{CID}\n4:pids:/\n", (True, "?")),  # a hierarchy twice
        ("0::/../../kubepods.slice/x.scope\n", (True, "?")),  # outside our cgroup namespace
    ],
)
def test_in_pod_and_pod_of_place_a_process_without_calling_anyone(
    tmp_path: Path, text: str, expect: tuple[bool, str | None]
) -> None:
    grants = KubernetesGrants(
        tmp_path / "none.sock", tmp_path / "none.sock", cgroup_of=lambda pid: text
    )
    assert (grants.in_pod(1), grants.pod_of(1)) == expect
    if expect[1] == "?":
        with pytest.raises(ConfigError, match="pid 1's cgroup "):
            grants.devices_of(1)
    elif expect[1] is None:
        assert grants.devices_of(1) is None


def test_the_cgroup_mounts_are_found_in_mountinfo() -> None:
    hybrid = (
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "90 41 0:38 /kubepods.slice /mnt/bind rw - cgroup2 cgroup2 rw\n"
    )
    assert cgroup_mount("", hybrid) == Path("/sys/fs/cgroup/unified")
    assert cgroup_mount("cpu,cpuacct", hybrid) == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert cgroup_mount("name=systemd", hybrid) == Path("/sys/fs/cgroup/systemd")
    assert cgroup_mount("memory", hybrid) is None
    only_v2 = (
        "90 41 0:38 /kubepods.slice /mnt/bind rw - cgroup2 cgroup2 rw\n"  # not the root
        "29 23 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    assert cgroup_mount("", only_v2) == Path("/sys/fs/my cgroup")


# -- root in a container is no one's exemption (issue 31, points 3 and 6) --------------------------


def test_root_in_a_container_the_agent_cannot_place_is_not_the_hosts_root(kube) -> None:
    """A container outside the kubelet's cgroup layouts (another cgroup root, another runtime)
    still runs in a pid namespace of its own: its uid 0 is refused, not admitted as root."""
    _, agent, _, _ = kube
    args = {"device": 0, "power_limit_w": 150.0}
    pod = PidNamespacePod(
        0, {"sock": str(agent.socket_path), "op": "set_power_limit", "args": args}
    )
    try:  # its cgroup reads as a host process's (the fixture's default: /user.slice)
        out, states = _converse(agent, pod.lines, pod.down_w)
    finally:
        pod.close()
    assert out.startswith("PermissionDeniedError: uid 0 may not control device 0")
    assert "a container's uid 0 is not the host's root" in out
    assert states == _defaults(agent)


def _as_pod_root(kube, text: str, body: Any, *, init: bool = False) -> Any:
    """Run ``body()`` in a forked root process placed in the cgroup ``text`` (and, with
    ``init``, reported by the runtime as its container's init); its JSON result."""
    node, _, cgroups, _ = kube
    r_go, w_go = os.pipe()

    def child(w: int) -> None:
        os.read(r_go, 1)  # placed in its pod first
        os.write(w, json.dumps(body()).encode())

    pid, r = spawn_as(0, child)
    cgroups[pid] = text
    if init:
        node.init_pids[CID] = pid  # a hostPID-style pod: its init in its own cgroup
    node.cri_requests.clear()
    os.write(w_go, b"g")
    os.close(w_go)
    os.close(r_go)
    try:
        assert select.select([r], [], [], 60)[0]
        return json.loads(os.read(r, 65536))
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_connections_are_capped_per_pod_its_root_included(kube) -> None:
    """Root in a pod was exempt from the per-uid cap: it could fill the connection table."""
    _, agent, _, _ = kube
    agent.max_per_uid = 4

    out = _as_pod_root(
        kube, cgroup_v2(POD_UID, CID), lambda: open_connections(agent.socket_path, 6)
    )
    assert out[:4] == ["ok"] * 4
    assert out[4].startswith(f"PermissionDeniedError: pod {POD_UID} holds 4 connections")


def test_a_pod_asking_again_and_again_costs_the_runtime_a_question_or_two(kube) -> None:
    """Each refusal used to ask the runtime again: a pod with no GPU hammering the agent made it
    call ContainerStatus ~1,100 times a second and slowed every client ~50x."""
    node, agent, _, _ = kube
    node.containers = [(CID, labels("notebook", "ml", POD_UID))]
    node.pods = [("ml", "notebook", [("trainer", {})])]
    text = cgroup_v2(POD_UID, CID)
    cgroup_tree(node.cgroup_fs, text)

    def hammer() -> list[str]:
        outs = set()
        conns = [AgentConnection(agent.socket_path) for _ in range(8)]
        for _ in range(25):
            for conn in conns:
                try:
                    conn.call("lock_sm_clocks", device=0, min_mhz=1005)
                    outs.add("ok")
                except PowerlibError as err:
                    outs.add(type(err).__name__)
        return sorted(outs)

    out = _as_pod_root(kube, text, hammer, init=True)
    assert out == ["PermissionDeniedError"]  # 200 refusals...
    assert len(node.cri_requests) <= 3, len(node.cri_requests)  # ...from a question or two
    assert _states(agent) == _defaults(agent)


# -- a pod is judged by its GPU container (issue 46, read-only finding) -----------------------------


def test_a_pod_is_judged_by_its_gpu_container_not_the_first_to_connect(kube) -> None:
    """A pod's standing (granted or not: its rate, and whether its connections count against
    the ungranted clients' share) was the standing of whichever container connected first: a
    sidecar without a GPU connecting first made its trainer, the container the kubelet gave a
    GPU, an ungranted client for a few seconds, turned away here by that share."""
    node, agent, cgroups, uuids = kube
    sidecar_cid = "cd" * 32
    node.containers = [
        (CID, labels("train-0", "ml", POD_UID)),
        (sidecar_cid, labels("train-0", "ml", POD_UID, "logs")),
    ]
    node.pods = [("ml", "train-0", [("trainer", {"nvidia.com/gpu": [uuids[1]]}), ("logs", {})])]
    agent.max_ungranted = 1
    sidecar = cgroup_v2(POD_UID, sidecar_cid)
    cgroup_tree(node.cgroup_fs, sidecar)
    down, w_down = os.pipe()
    pid, r = spawn_as(NOBODY, lambda w: _client(agent.socket_path, down, w, "devices", {}))
    os.close(down)
    try:
        cgroups[pid] = sidecar
        node.init_pids[sidecar_cid] = pid
        os.write(w_down, b"g")
        assert Lines(r).get("result") == "ok"  # the sidecar first, and it holds its connection
        assert agent.rules.kubernetes is not None
        assert agent.rules.kubernetes.pod_granted(pid) is True  # its pod has a GPU container
        out, states = _attempt(kube, NOBODY, cgroup_v2(POD_UID, CID), 1)
    finally:
        with contextlib.suppress(OSError):
            os.write(w_down, b"r")
        os.close(w_down)
        os.close(r)
        os.waitpid(pid, 0)
    assert out == "ok", out  # before: turned away (the client saw its socket closed)
    assert states[1][0] is not None and states[0] == _defaults(agent)[0]


def test_a_pod_without_a_gpu_container_is_not_granted(kube) -> None:
    node, agent, cgroups, _ = kube
    node.containers = [(CID, labels("notebook", "ml", POD_UID))]
    node.pods = [
        ("ml", "notebook", [("trainer", {})]),
        ("ml", "other", [("trainer", {"nvidia.com/gpu": ["GPU-x"]})]),  # another pod's GPU
    ]
    text = cgroup_v2(POD_UID, CID)
    cgroup_tree(node.cgroup_fs, text)
    grants = agent.rules.kubernetes
    assert grants is not None
    cgroups[4242] = text
    assert grants.pod_granted(4242) is False
    cgroups[4243] = "0::/user.slice\n"
    assert grants.pod_granted(4243) is False  # a host process: no pod to judge
    cgroups[4244] = "garbage\n"
    with pytest.raises(ConfigError, match="cgroup has a line"):
        grants.pod_granted(4244)
