"""The node agent's client: ``POWERLIB_BACKEND=agent`` (or ``agent:nvidia``), no root needed.

Every change (clock locks, power limits) goes to the ``powerlib agent`` of this node over its Unix
socket (``POWERLIB_AGENT_SOCKET``, default ``/run/powerlib/agent/agent.sock``), which checks the caller's
grant, journals the change and leases the device to this process until it disconnects or dies
(docs/agent.md). Reads go through the agent too with plain ``agent``; with ``agent:NAME`` they are
made locally through backend ``NAME`` (NVML, amdsmi and sysfs reads need no privilege), which
saves a round trip per read.

So ``powerlib.optimize``, every integration and the CLI work unchanged as a normal user. This
process journals nothing itself (``persistent`` is False: the agent's journal is the one that
counts), but its first change still claims the device (``remote``).

If the agent goes away mid-run (the connection drops), training goes on at whatever clock is set,
with one warning: the agent restores a lease when its connection closes, and an agent restarted
after a crash restores from its journals before serving anyone. Later changes are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

from powerlib.agent import protocol
from powerlib.agent.client import AgentConnection
from powerlib.backend import Backend, ProbeResult
from powerlib.config import Settings
from powerlib.device import ClockLockState, Device, PowerState
from powerlib.errors import BackendUnavailableError, DeviceLostError
from powerlib.inputs import show_path

__all__ = ["AgentBackend", "AgentDevice"]

logger = logging.getLogger(__name__)


class AgentDevice(Device):
    """A device the agent serves; reads locally when a local backend was given."""

    def __init__(self, backend: AgentBackend, info: Any, local: Device | None) -> None:
        super().__init__(info)
        self._backend = backend
        self._local = local
        self._last: PowerState | None = None

    def details(self) -> dict[str, object]:
        """Where changes go and where reads come from."""
        return {
            "agent_socket": str(self._backend.connection.path),
            "reads": "local" if self._local is not None else "agent",
        }

    def _ask(self, op: str, **args: Any) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` once the connection is lost.

        A connection that holds no lease (no change made through it yet) is reopened when it
        was lost (the agent closes idle lease-less connections, docs/agent.md §5), once per
        call. Once a change was made, a lost connection stays lost: the agent restored the
        device when it closed, and later changes are dropped. The loss is warned of once. A
        device the agent reports lost still raises: that is the device, not the connection.
        """
        backend = self._backend
        for _ in range(2):
            conn = backend.live_connection()
            if conn.lost:
                break
            try:
                result = conn.call(op, device=self.device_id, **args)
            except DeviceLostError:
                if not conn.lost:
                    raise
                continue
            if op in protocol.CHANGES:
                backend.leased = True
            return True, result
        backend.warn_lost()
        return False, None

    def _read_state(self) -> PowerState:
        if self._local is not None:
            return self._local.read_state()
        answered, data = self._ask("read")
        if answered:
            self._last = protocol.state_from_wire(data)
        elif self._last is None:
            raise DeviceLostError(
                "the powerlib agent connection was lost before the device was read",
                device=self.device_id,
            )
        # with the agent gone the last state read stands (its energy counter stops, which a
        # profile notices and a measurement marks): training goes on
        return self._last

    def _read_sm_lock(self) -> ClockLockState:
        """Nothing to add here: the agent reads every write back on its own device.

        The agent's ``Device.lock_sm_clocks`` verifies the lock against the driver
        (docs/real-gpu.md §1) and answers with the error if the driver contradicts it; a second
        read through the socket would only add a round trip, or, with the agent gone, read the
        last state again.
        """
        return ClockLockState(locked=None)

    def _change(self, op: str, **args: Any) -> Any:
        return self._ask(op, **args)[1]

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        self._change("lock_sm_clocks", min_mhz=min_mhz, max_mhz=max_mhz)

    def _reset_sm_clocks(self) -> None:
        self._change("reset_sm_clocks")

    def _set_power_limit(self, power_limit_w: float) -> float:
        applied = self._change("set_power_limit", power_limit_w=power_limit_w)
        return float(applied) if isinstance(applied, (int, float)) else power_limit_w

    def _reset_power_limit(self) -> None:
        self._change("reset_power_limit")


class AgentBackend(Backend):
    """The devices of this node's agent (see the module docstring)."""

    name: ClassVar[str] = "agent"
    install_hint: ClassVar[str] = (
        "run `powerlib agent` as root on the node (docs/agent.md) and set POWERLIB_AGENT_SOCKET "
        "if its socket is not /run/powerlib/agent/agent.sock"
    )

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.persistent = False  # the agent journals; nothing of ours outlives the connection
        self.remote = True
        inner = settings.backend.partition(":")[2] if settings.backend.startswith("agent:") else ""
        self.connection = AgentConnection(settings.agent_socket)
        self.leased = False
        """Whether a change went through this backend's connection (then it is never reopened)."""
        self._closed = False
        self._warned = False
        self._local_backend: Backend | None = None
        try:
            self.hello = self.connection.call("hello")
            wire = self.connection.call("devices")
            local: dict[str, Device] = {}
            if inner:
                from powerlib.registry import open_backend  # noqa: PLC0415 - no import cycle

                self._local_backend = open_backend(inner, settings)
                local = {d.device_id: d for d in self._local_backend.devices()}
            infos = [protocol.info_from_wire(data, backend=self.name) for data in wire]
            if inner:  # what NAME sees here (CUDA_VISIBLE_DEVICES), indexed as NAME indexes it
                infos = [i for i in infos if i.device_id in local]
                order = {dev_id: n for n, dev_id in enumerate(local)}
                infos.sort(key=lambda i: order[i.device_id])
            self._devices: list[AgentDevice] = [
                AgentDevice(self, dataclasses.replace(info, index=n), local.get(info.device_id))
                for n, info in enumerate(infos)
            ]
        except BaseException:
            self.close()
            raise

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Available when an agent answers on the socket (never chosen by ``auto``)."""
        try:
            conn = AgentConnection(settings.agent_socket, timeout_s=2.0)
        except BackendUnavailableError as err:
            return ProbeResult(backend=cls.name, is_available=False, reason=err.message)
        try:
            devices = conn.call("devices")
            return ProbeResult(
                backend=cls.name, is_available=True, num_devices=len(devices),
                reason=f"agent at {show_path(settings.agent_socket)}",
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - probe never raises
            return ProbeResult(backend=cls.name, is_available=False, reason=f"agent: {err}")
        finally:
            conn.close()

    def devices(self) -> Sequence[Device]:
        """The agent's devices (with ``agent:NAME``, those ``NAME`` sees here), in order."""
        return self._devices

    def live_connection(self) -> AgentConnection:
        """The connection, reopened first if it was lost while it held no lease."""
        if self.connection.lost and not self.leased and not self._closed:
            try:
                self.connection = AgentConnection(self.settings.agent_socket)
            except BackendUnavailableError:
                pass  # the agent is gone: stays lost
        return self.connection

    def warn_lost(self) -> None:
        """One warning for the whole process: the agent is gone, training goes on."""
        if self._warned:
            return
        self._warned = True
        message = (
            "the powerlib agent connection was lost: training goes on at whatever clock is set "
            "(the agent restores the devices it leased to this job); later clock changes are dropped"
        )
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        """Disconnect (the agent restores what this process leased) and close local reads."""
        self._closed = True
        self.connection.close()
        if self._local_backend is not None:
            self._local_backend.close()
            self._local_backend = None
