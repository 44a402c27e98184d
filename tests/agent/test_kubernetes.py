"""Kubernetes grants: a fake kubelet (pod-resources) and a fake container runtime (CRI), both real
gRPC servers on Unix sockets, and clients forked into "pods" (their cgroup text is given to the
agent, keyed by pid, as /proc/<pid>/cgroup would show it).

The protobuf replies are built here with a few lines of encoder of their own, independent of the
decoder under test, from the field numbers of kubelet's pod-resources v1 and CRI runtime v1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest
from test_agent import NOBODY, _try, spawn_as
from test_agent import root_dir as root_dir  # the fixture, shared

from powerlib.agent.authz import Rules
from powerlib.agent.client import AgentConnection
from powerlib.agent.kubernetes import KubernetesGrants, container_of_cgroup
from powerlib.agent.server import Agent
from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings
from powerlib.errors import ConfigError

grpc = pytest.importorskip("grpc")

POD_UID = "6f1c2d3e-4a5b-4c6d-8e9f-0a1b2c3d4e5f"
CID = "ab" * 32


def cgroup_v2(pod_uid: str, cid: str, runtime: str = "cri-containerd") -> str:
    slice_uid = pod_uid.replace("-", "_")
    return (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{slice_uid}.slice/{runtime}-{cid}.scope\n"
    )


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


class FakeNode:
    """The kubelet's pod-resources service and the runtime's CRI service, on Unix sockets."""

    def __init__(self, root: Path) -> None:
        self.pod_sock = root / "kubelet.sock"
        self.cri_sock = root / "containerd.sock"
        self.pods: list = []
        self.containers: list = []
        self.cri_requests: list[bytes] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
                "List": grpc.unary_unary_rpc_method_handler(lambda req, ctx: pod_resources(self.pods)),
            }),
            grpc.method_handlers_generic_handler("runtime.v1.RuntimeService", {
                "ListContainers": grpc.unary_unary_rpc_method_handler(self._list_containers),
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

    def stop(self) -> None:
        self.server.stop(grace=None)


@pytest.fixture
def kube(root_dir: Path) -> Iterator[tuple[FakeNode, Agent, dict[int, str], list[str]]]:
    node = FakeNode(root_dir)
    cgroups: dict[int, str] = {}
    backend = SimulatedBackend(
        Settings(backend="simulated", sim_gpus=2, state_dir=root_dir / "state")
    )
    uuids = [d.device_id for d in backend.devices()]
    grants = KubernetesGrants(
        node.pod_sock, node.cri_sock, cgroup_of=lambda pid: cgroups.get(pid, "0::/user.slice\n")
    )
    sock = root_dir / "run" / "agent.sock"
    agent = Agent(backend, socket_path=sock, rules=Rules(kubernetes=grants), group=65534)
    with agent.in_thread():
        yield node, agent, cgroups, uuids
    backend.close()
    node.stop()


def _in_pod(kube, uid: int, cgroup: str, device: int) -> str:
    """A client forked as ``uid`` whose cgroup is ``cgroup``: its attempt to lock ``device``."""
    node, agent, cgroups, _ = kube
    sock = agent.socket_path
    r_go, w_go = os.pipe()

    def attempt(w: int) -> None:
        os.read(r_go, 1)  # wait until the test has put this process in its "pod"
        with AgentConnection(sock) as conn:
            out = _try(lambda: conn.call("lock_sm_clocks", device=device, min_mhz=1005))
        os.write(w, out.encode())

    pid, r = spawn_as(uid, attempt)
    cgroups[pid] = cgroup
    os.write(w_go, b"x")
    os.close(w_go)
    os.close(r_go)
    import select

    assert select.select([r], [], [], 60)[0]
    out = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return out


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
