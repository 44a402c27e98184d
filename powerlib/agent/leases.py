"""The agent's leases: who holds which device, the changes made through it, and its restore.

The node agent (:mod:`powerlib.agent.transport`) hands each request line it reads to
:meth:`Leases.dispatch`, which answers it for that connection (docs/agent.md §2-§4):

* **Default deny.** A device operation names a device by any id form; it is resolved to the
  device's UUID and judged by the rules (:mod:`powerlib.agent.authz`) for the client the kernel
  vouches for (a pod's verdict is kept for the connection).
* **Lease = connection.** A client's first change of a device takes its lease (one owner per
  device; another client gets ``DeviceBusyError`` naming the owner's uid, pid and job). Each
  lease is a :class:`~powerlib.control.ControlSession` of the agent's, so every change is
  journaled before it is made. When the connection closes, or the client process dies, the
  transport calls :meth:`Leases.end_client`: each of its devices is restored to what it was
  before the lease, compare-then-restore, one device at a time so one failure stops no other.
  A job's leases end with its grant (:meth:`Leases.end_gone_jobs`, op ``revoke``).
* **Crash safety.** :meth:`Leases.prepare` restores whatever journals a dead agent left before
  the agent serves anyone, and holds a lock file so that two agents never serve one state folder.
* **Device calls** run on the event loop while the device answers fast, else on a thread pool
  (:meth:`Leases.call`), so a device that stalls delays only its own clients.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import fcntl
import logging
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerlib.agent import protocol
from powerlib.agent.authz import Grant, Rules
from powerlib.agent.events import AgentEvent, JobEvents
from powerlib.agent.logs import LogLimiter, log_privileged
from powerlib.agent.peer import Peer
from powerlib.backend import Backend, normalize_pci
from powerlib.control import ControlSession, restore_journals
from powerlib.device import Device
from powerlib.errors import (
    ConfigError,
    DeviceBusyError,
    DeviceLostError,
    DeviceNotFoundError,
    PermissionDeniedError,
    PowerlibError,
)
from powerlib.inputs import show_path

__all__ = ["AgentEvent", "Client", "JobEvents", "Lease", "Leases"]

logger = logging.getLogger(__name__)

_OFFLOAD_CALLS = 100
"""After a slow call, how many of that device's calls go to the thread pool before one is tried
inline again."""
_JOBS_KEPT = 1024
"""Jobs whose ended leases are kept until their ``revoke`` (a grant removed by hand never
revokes: the oldest job's record goes first)."""


@dataclass
class Client:
    """One connection: who is on the other end, its leases, and its share of the agent."""

    id: int
    peer: Peer
    writer: asyncio.StreamWriter
    pidfd: int | None = None
    leases: dict[str, Lease] = field(default_factory=dict)
    ended: bool = False
    tokens: float = 0.0
    refilled_s: float = 0.0
    verdicts: dict[str, tuple[bool, str]] = field(default_factory=dict)
    """A pod's verdict per device, kept for the connection (docs/agent.md §3)."""
    pool: str = ""
    """Whose share of the connection table it counts against: ``uid:<n>``, ``pod:<uid>``."""
    granted: bool = True
    """Whether a rule could admit it on some device when it connected (else it is in the small
    pool of ungranted connections, which can never crowd out a granted job)."""
    active_s: float = 0.0
    """When it last sent a request (monotonic): lease-less connections idle too long close."""
    busy: bool = False
    """A request of it is being answered (never idle then)."""
    log_limit: LogLimiter = field(default_factory=LogLimiter)
    """The log lines this connection may cause: refusals, protocol errors (docs/agent.md §5)."""


@dataclass
class Lease:
    """One device held by one client, through a journaled session of the agent's."""

    device: Device
    client: Client
    rule: str
    session: ControlSession
    since_s: float
    journaled: bool = False
    """Whether a change was made: the first writes and fsyncs the journal, on the pool."""
    changes: dict[str, int] = field(default_factory=dict)
    """Changes through it that succeeded, per item; a lease whose first change failed is dropped."""
    targets: dict[str, object] = field(default_factory=dict)
    """The value each item was last set to through this lease (for a restore's report)."""
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a change in flight and by the restore: a restore never runs under a change that
    a worker thread is still making (which would land after it, unjournaled)."""


class Leases:
    """The node's devices and their leases; answers each request of a connection.

    Args:
        backend: The real backend (or the simulated one); the agent owns it.
        rules: Who may control what (its device ids are resolved through this table).
        workers: Threads for device calls that are slow.
        inline_below_s: A device whose calls take less runs them on the event loop (see
            :meth:`call`); 0 sends every call to the thread pool.
    """

    def __init__(
        self, backend: Backend, rules: Rules, *, workers: int, inline_below_s: float
    ) -> None:
        self.backend = backend
        self.rules = rules
        self.inline_below_s = inline_below_s
        self._job_events: dict[str, JobEvents] = {}
        """Leases each job grant admitted that ended, until ``revoke`` reports them (bounded:
        :data:`~powerlib.agent.events.JOB_EVENTS` per job, :data:`_JOBS_KEPT` jobs)."""
        self._offload: dict[str, int] = {}
        self._slow: dict[str, int] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="powerlib-agent"
        )
        self._leases: dict[str, Lease] = {}
        self._by_form: dict[str, Device] = {}
        self.wire_devices: list[dict[str, object]] = []
        """Every device's static facts, as op ``devices`` answers them."""
        self.events: collections.deque[AgentEvent] = collections.deque(maxlen=10_000)
        """The latest ended leases (bounded: a client looping change/release cannot grow it)."""
        self._lock_fd: int | None = None
        self.recovered: list[Any] = []
        rules.resolve = self._resolve_id

    # -- start and stop --------------------------------------------------------------------------

    @property
    def prepared(self) -> bool:
        """:meth:`prepare` ran (and :meth:`close` did not yet)."""
        return self._lock_fd is not None

    def prepare(self) -> None:
        """Take the state folder's agent lock, restore what a dead agent left, index devices.

        Raises:
            ConfigError: Another agent serves this state folder.
        """
        state = Path(self.backend.settings.state_dir)
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(
            state / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another powerlib agent serves the state folder {show_path(state)}"
            ) from None
        self._lock_fd = fd
        # A dead agent's leases: its journals name it as the owner, and it is gone.
        self.recovered = restore_journals(self.backend.settings)
        for outcome in self.recovered:
            (logger.info if outcome.ok else logger.error)("start-up restore: %s", outcome)
        for dev in self.backend.devices():
            details = dict(dev.details())
            self.wire_devices.append(protocol.info_to_wire(dev.info, details))
            self._by_form[str(dev.index)] = dev
            self._by_form[dev.device_id] = dev
            self._by_form[dev.device_id.lower()] = dev
            pci = details.get("pci_bus_id")
            bus_id = normalize_pci(pci) if isinstance(pci, str) else None
            if bus_id is not None:
                self._by_form[bus_id] = dev

    def close(self) -> None:
        """Release the thread pool and the agent lock (leases were restored by then)."""
        self._pool.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- operations ------------------------------------------------------------------------------

    async def dispatch(self, client: Client, msg: dict[str, Any]) -> Any:
        """Answer one decoded request of ``client``: the result, or the PowerlibError to send."""
        op = msg["op"]
        peer = client.peer
        if op == "ping":
            return None
        if op == "hello":
            return {
                "protocol": protocol.PROTOCOL,
                "version": protocol.VERSION,
                "backend": self.backend.name,
                "uid": peer.uid,
                "pid": peer.pid,
                "agent_pid": os.getpid(),
            }
        if op == "devices":
            return self.wire_devices
        if op == "leases":
            host_root = client.pool == "root"
            return [
                {"device_id": k, "uid": v.client.peer.uid, "pid": v.client.peer.pid, "rule": v.rule,
                 "since_s": v.since_s}
                for k, v in self._leases.items()
                if host_root or v.client is client
            ]  # fmt: skip
        if op == "revoke":
            if client.pool != "root":  # root on the host (a Slurm epilog), not a pod's root
                raise PermissionDeniedError(
                    f"{peer.describe()} may not revoke a job's grant: only root on the host may",
                    operation=op,
                )
            self.rules.invalidate(revoked=msg["job"])
            return await self._revoke(msg["job"], peer.describe())
        dev = self._resolve(msg["device"])
        allowed, why = await self._authorize(client, dev, _shown(msg["device"], dev))
        if not allowed:
            client.log_limit.log(
                logger, logging.WARNING, "agent: refused %s %s: %s", op, peer.describe(),
                protocol.one_line(why),
            )  # fmt: skip
            raise PermissionDeniedError(why, device=dev.device_id, operation=op)
        if op == "read":
            state = await self.call(dev.read_state, device=dev.device_id)
            return protocol.state_to_wire(state)
        if op == "release":
            lease = client.leases.get(dev.device_id)
            if lease is not None:
                await self.restore(lease, "released")
            return None
        lease = self._lease(client, dev, why)
        try:
            async with lease.busy:
                if self._leases.get(dev.device_id) is not lease:  # restored while this waited
                    raise DeviceLostError(
                        "the lease ended (the client is gone, or its grant was revoked)",
                        device=dev.device_id,
                    )
                result = await self._change(op, lease, msg)
                item = "sm_clocks" if op.endswith("sm_clocks") else "power_limit"
                count = lease.changes[item] = lease.changes.get(item, 0) + 1
                # a lease's first change of an item has its line; a plan switches clocks per
                # instruction (thousands an hour), so later clock changes log at DEBUG and the
                # restore's line counts them (docs/agent.md §5)
                log_privileged(
                    logger, "agent: %s: %s %s: %s (%s)", peer.describe(), op, dev.device_id,
                    _value(item, lease.targets.get(item)), lease.rule,
                    level=logging.DEBUG if count > 1 and item == "sm_clocks" else logging.INFO,
                )  # fmt: skip
                return result
        except BaseException:
            if not lease.changes and self._leases.get(dev.device_id) is lease:
                # a failed first change leaves no lease: the device stays free for others
                await self.restore(lease, "its first change failed")
            raise

    async def _change(self, op: str, lease: Lease, msg: dict[str, Any]) -> Any:
        dev = lease.device
        # the lease's first change journals (write + fsync): never on the event loop
        where = dev.device_id if lease.journaled else None
        lease.journaled = True
        if op == "lock_sm_clocks":
            lo, hi = await self.call(
                lease.session.lock_sm_clocks,
                dev,
                msg["min_mhz"],
                msg.get("max_mhz"),
                device=where,
            )
            lease.targets["sm_clocks"] = [lo, hi]
            return [lo, hi]
        if op == "reset_sm_clocks":
            await self.call(lease.session.reset_sm_clocks, dev, device=where)
            lease.targets["sm_clocks"] = None
            return None
        if op == "set_power_limit":
            applied = await self.call(
                lease.session.set_power_limit, dev, msg["power_limit_w"], device=where
            )
            lease.targets["power_limit"] = applied
            return applied
        if op == "reset_power_limit":
            await self.call(lease.session.reset_power_limit, dev, device=where)
            lease.targets["power_limit"] = dev.info.default_power_limit_w
            return None
        raise protocol.ProtocolError(f"unknown operation {op!r}")  # decode_request stops these

    async def _authorize(self, client: Client, dev: Device, shown: str) -> tuple[bool, str]:
        """The rules' verdict for this client and device.

        A host process is judged on the event loop (its rules read only files). A process in a
        pod is judged on the pool (the kubelet and the runtime may be asked), and the verdict,
        either way, is kept for the connection: a container's devices do not change while it
        runs, and a pod that keeps asking for a device it was not given must not make the
        agent ask the runtime for each request.
        """
        peer = client.peer
        if not client.pool.startswith("pod:"):
            return self.rules.check(peer.uid, peer.gids, dev.device_id, shown, peer.pid)
        verdict = client.verdicts.get(dev.device_id)
        if verdict is not None:
            return verdict
        try:
            verdict = await self.call(
                self.rules.check, peer.uid, peer.gids, dev.device_id, shown, peer.pid
            )
        except PowerlibError as err:
            verdict = (
                False,
                f"uid {peer.uid} pid {peer.pid}: cannot tell which pod it runs in: {err.message}",
            )
        if client.pidfd is None or _exited(client.pidfd):
            # the process was read by pid on the pool: if it is gone, that pid may now be
            # someone else's, and the verdict theirs
            raise DeviceLostError("the client is gone", device=dev.device_id)
        client.verdicts[dev.device_id] = verdict
        return verdict

    def _resolve(self, selector: str | int) -> Device:
        dev = self._lookup(selector)
        if dev is None:
            raise DeviceNotFoundError(
                f"no device {selector!r} on this node (an index, UUID or PCI bus id; "
                f"{len(self.wire_devices)} device(s))"
            )
        return dev

    def _lookup(self, selector: str | int) -> Device | None:
        text = str(selector).strip()
        dev = self._by_form.get(text) or self._by_form.get(text.lower())
        if dev is None:
            pci = normalize_pci(text)
            dev = self._by_form.get(pci) if pci else None
        return dev

    def _resolve_id(self, selector: str) -> str | None:
        dev = self._lookup(selector)
        return None if dev is None else dev.device_id

    def _lease(self, client: Client, dev: Device, rule: str) -> Lease:
        if client.ended:  # its process exited while this request waited: no new lease
            raise DeviceLostError("the client is gone", device=dev.device_id)
        lease = self._leases.get(dev.device_id)
        if lease is not None and lease.client is not client:
            owner = lease.client.peer
            raise DeviceBusyError(
                f"leased by uid {owner.uid} pid {owner.pid} ({lease.rule}) since "
                f"{time.strftime('%H:%M:%S', time.localtime(lease.since_s))}",
                device=dev.device_id,
            )
        if lease is None:
            # No guardian per lease: the agent restores every lease when a client goes and its
            # own journals when it restarts (docs/agent.md); a guardian per lease would also
            # restore under a restarted agent (docs/real-gpu.md §6).
            session = ControlSession(self.backend, guardian=False, handle_signals=False)
            lease = Lease(
                device=dev, client=client, rule=rule, session=session, since_s=time.time()
            )
            self._leases[dev.device_id] = lease
            client.leases[dev.device_id] = lease
            # a privileged action: always its line, whatever the client's refusals spent
            log_privileged(
                logger, "agent: %s leases %s (%s)", client.peer.describe(), dev.device_id, rule
            )
        return lease

    async def call(self, fn: Callable[..., Any], *args: Any, device: str | None = None) -> Any:
        """Run a device call: inline while the device answers fast, else on the thread pool.

        Handing a call to a thread and back costs ~0.1 ms on a loaded 2-core node, as much as a
        fast driver call itself. A device's calls run on the event loop until two in a row take
        longer than ``inline_below_s`` (one slow call is normal: a lease's first change writes
        and fsyncs its journal); then the next :data:`_OFFLOAD_CALLS` calls of that device go
        to the pool, so a device that stalls delays only its own clients. A call for no device
        (``device=None``) always runs on the pool.
        """
        inline = (
            self.inline_below_s > 0 and device is not None and self._offload.get(device, 0) <= 0
        )
        t0 = time.perf_counter()
        try:
            if inline:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            if device is not None:
                slow = time.perf_counter() - t0 > self.inline_below_s
                if inline:
                    streak = self._slow.get(device, 0) + 1 if slow else 0
                    self._slow[device] = streak
                    if streak >= 2:
                        self._offload[device] = _OFFLOAD_CALLS
                else:
                    self._offload[device] = _OFFLOAD_CALLS if slow else self._offload[device] - 1

    # -- the end of a lease ----------------------------------------------------------------------

    async def end_client(self, client: Client, reason: str, detected_s: float) -> None:
        """Restore every device ``client`` leased (it is gone: ``reason``), each on its own."""
        leases = list(client.leases.values())
        if leases:
            log_privileged(
                logger, "agent: %s: %s; restoring %d device(s)", client.peer.describe(), reason,
                len(leases),
            )  # fmt: skip
        # each device on its own: one that fails does not stop the others
        await asyncio.gather(*(self.restore(lease, reason, detected_s) for lease in leases))

    async def end_all(self, reason: str) -> None:
        """Restore every lease still held, one after the other (the agent is stopping).

        A restore already in flight is waited for: it holds its lease's lock.
        """
        for lease in list(self._leases.values()):
            await self.restore(lease, reason)

    async def end_gone_jobs(self) -> None:
        """End the leases of every job whose grant is gone (the housekeeping's second task).

        A lease also ends when its job's grant no longer names its device: the prolog of the
        next job on that device takes it out of a grant a failed epilog left (docs/agent.md §3).
        """
        grants = [g for g in self.rules.grants()[0] if g.job is not None]
        gone, moved = set(), []
        for lease in (x for x in self._leases.values() if x.rule.startswith("job:")):
            mine = [g for g in grants if g.job == lease.rule[4:]]
            if not mine:
                gone.add(lease.rule[4:])
            elif not any(self._names(g, lease.device.device_id) for g in mine):
                moved.append(lease)
        for job in gone:
            await self._end_job(job, f"job {job}'s grant is gone")
        reason = "its job's grant no longer names the device (another job's now)"
        await asyncio.gather(*(self.restore(lease, reason) for lease in moved))

    def _names(self, grant: Grant, dev_id: str) -> bool:
        return "*" in grant.devices or any(self._resolve_id(s) == dev_id for s in grant.devices)

    async def _end_job(self, job: str, reason: str) -> None:
        """End and restore every lease job ``job``'s grant admitted.

        A lease being ended already (by the housekeeping, or its client's end) is awaited too:
        its restore holds the lease's lock.
        """
        leases = [lease for lease in self._leases.values() if lease.rule == f"job:{job}"]
        if leases:
            logger.info("agent: %s: ending %d lease(s)", reason, len(leases))
        await asyncio.gather(*(self.restore(lease, reason) for lease in leases))

    async def _revoke(self, job: str, by: str = "root") -> dict[str, object]:
        """``powerlib agent revoke`` (asked by ``by``): end the job's leases.

        Returns the latest leases of the job that ended (whoever ended them) and a count of the
        earlier ones (:class:`JobEvents`).
        """
        shown = protocol.one_line(job)
        await self._end_job(job, f"job {shown}'s grant was revoked")
        record = self._job_events.pop(job, JobEvents())
        log_privileged(
            logger, "agent: revoke job %s (%s): %d lease(s) ended since the last revoke, "
            "%d of them not restored cleanly", shown, by, len(record.recent) + record.left_out,
            record.left_out_failed + sum(not e.ok for e in record.recent),
        )  # fmt: skip
        return record.to_wire()

    async def restore(
        self, lease: Lease, reason: str, detected_s: float | None = None
    ) -> AgentEvent | None:
        """Restore ``lease``'s device and end the lease; its event (None: already ended)."""
        dev_id = lease.device.device_id
        detected = time.monotonic() if detected_s is None else detected_s
        async with lease.busy:  # after a change in flight, never under it
            if self._leases.get(dev_id) is not lease:
                return None  # already restored (a release and the client's end can both ask)
            event = AgentEvent(
                device_id=dev_id, pid=lease.client.peer.pid, uid=lease.client.peer.uid,
                reason=reason, detected_s=detected,
            )  # fmt: skip
            self.events.append(event)

            def restore() -> list[Any]:
                event.restore_started_s = time.monotonic()
                return lease.session.close()

            try:
                outcomes = await self.call(restore)
                # a value the lease did not set (another root process changed the device under
                # it) is left as found, and the lease's restore is not ok: say which and whose
                event.ok = all(o.ok and o.found is None for o in outcomes)
                peer = lease.client.peer
                for o in outcomes:
                    if o.found is not None:
                        logger.error(
                            "agent: restore %s: not ok: its %s reads %s, not the %s that %s (%s) "
                            "set through the agent: someone else changed it; left as found",
                            dev_id, o.item.replace("_", " "), _value(o.item, o.found),
                            _value(o.item, lease.targets.get(o.item)), peer.describe(), lease.rule,
                        )  # fmt: skip
                        continue
                    if not o.ok:  # a failure is always told, with all it knows
                        logger.error("agent: restore %s: %s", dev_id, o)
                done = "; ".join(o.action for o in outcomes) or "nothing was changed"
                log_privileged(
                    logger, "agent: restore %s: the lease of %s (%s) ended (%s) after %d "
                    "change(s): %s", dev_id, peer.describe(), lease.rule, reason,
                    sum(lease.changes.values()), done,
                    level=logging.INFO if event.ok else logging.ERROR,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - ControlSession.close never raises; belt and braces
                logger.exception("agent: restoring %s failed", dev_id)
            finally:
                event.restore_done_s = time.monotonic()
                self._leases.pop(dev_id, None)
                lease.client.leases.pop(dev_id, None)
                if lease.rule.startswith("job:"):  # for `powerlib agent revoke`'s report
                    self._job_event(lease.rule[4:], event)
        return event

    def _job_event(self, job: str, event: AgentEvent) -> None:
        """Keep a job's ended lease (once its restore is done: whether it was ok is known)."""
        while job not in self._job_events and len(self._job_events) >= _JOBS_KEPT:
            self._job_events.pop(next(iter(self._job_events)))  # the oldest job's goes first
        self._job_events.setdefault(job, JobEvents()).add(event)


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (the pidfd is readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def _value(item: str, value: Any) -> str:
    """A setting for a log line: ``250 W``, ``1200-1410 MHz``, ``unlocked``."""
    if value is None:
        return "unlocked" if item != "power_limit" else "unknown"
    if isinstance(value, (list, tuple)):
        return "{:g}-{:g} MHz".format(*value)
    return f"{float(value):g} W"


def _shown(selector: str | int, dev: Device) -> str:
    text = str(selector)
    return text if text == dev.device_id else f"{text} ({dev.device_id})"
