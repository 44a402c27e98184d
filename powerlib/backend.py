"""The backend contract: what opens the devices of one kind of hardware, and finds one of them.

A :class:`Backend` (NVML, amdsmi, Linux sysfs, the simulator, the node agent, a plug-in) opens the
:class:`~powerlib.device.Device` objects of its hardware; :mod:`powerlib.registry` chooses which
one runs, and :class:`ProbeResult` is its cheap answer to "could it start here?" (``powerlib env``).

Finding a device: :meth:`Backend.device` takes what a user types (an index, a stable id or a
unique id prefix); :func:`match_device` is the exact form for code that acts for someone else (no
prefixes). :func:`gpu_uuid_key` and :func:`normalize_pci` put the ids other libraries report
(torch's bare UUID, a PCI bus id in any spelling) in the form devices are compared by
(docs/real-gpu.md §4).
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

from powerlib.config import Settings
from powerlib.device import Device
from powerlib.errors import DeviceNotFoundError

__all__ = ["Backend", "ProbeResult", "gpu_uuid_key", "match_device", "normalize_pci"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """Whether a backend can start here, and why (shown by ``powerlib env``).

    Attributes:
        backend: Registry name.
        is_available: True if opening the backend should succeed.
        reason: One line: what was found, or what is missing and how to get it.
        num_devices: Devices found when available.
    """

    backend: str
    is_available: bool
    reason: str
    num_devices: int = 0


class Backend(ABC):
    """Opens the devices of one kind of hardware.

    A backend is constructed by :func:`powerlib.registry.open_backend`; constructing it raises
    ``BackendUnavailableError`` (naming what to install) when it cannot start. ``probe`` answers
    the same question cheaply and never raises.

    Attributes:
        name: Registry name (``POWERLIB_BACKEND`` value).
        install_hint: What to install or enable when the backend is unavailable.
        persistent: True when device settings outlive this process (real hardware; the simulator
            with persisted state). Only then are changes journaled and devices locked.
        remote: True when another process makes the changes and journals and leases them (the
            node agent, docs/agent.md): nothing is journaled here, but the first change still
            claims the device.
    """

    name: ClassVar[str]
    install_hint: ClassVar[str] = ""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.persistent = True
        self.remote = False

    @classmethod
    @abstractmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Check availability without side effects on devices; never raises."""

    @abstractmethod
    def devices(self) -> Sequence[Device]:
        """The devices this backend controls, in index order."""

    def device(self, selector: int | str) -> Device:
        """Find one device by index, stable id, or unique id prefix.

        Raises:
            DeviceNotFoundError: Nothing matches, or an id prefix is ambiguous.
        """
        devices = self.devices()
        if isinstance(selector, int) or (isinstance(selector, str) and selector.isdigit()):
            index = int(selector)
            if 0 <= index < len(devices):
                return devices[index]
            raise DeviceNotFoundError(
                f"no device with index {index}: the {self.name} backend has {len(devices)} device(s)"
                + (f" (0-{len(devices) - 1})" if devices else "")
            )
        exact = [d for d in devices if d.device_id == selector]
        if exact:
            return exact[0]
        prefixed = [d for d in devices if d.device_id.startswith(selector)]
        if len(prefixed) == 1:
            return prefixed[0]
        if prefixed:
            raise DeviceNotFoundError(
                f"device id prefix {selector!r} is ambiguous: "
                + ", ".join(d.device_id for d in prefixed)
            )
        raise DeviceNotFoundError(
            f"no device with id {selector!r}; known ids: "
            + (", ".join(d.device_id for d in devices) or "none")
        )

    def versions(self) -> dict[str, str | None]:
        """What the backend can say about its driver and library (``powerlib check``).

        Keys are names (``driver``, ``nvml``, ``model``...), values version strings or ``None``
        where unreadable. Never raises. Empty by default.
        """
        return {}

    def steady_load(self, device: Device) -> contextlib.AbstractContextManager[str] | None:
        """A context that keeps ``device`` busy while it is open (yields what runs), or ``None``.

        Backends that can run work themselves (the simulator) offer it; real GPUs need a
        framework's kernels (``powerlib check --load`` runs a torch matmul there).
        """
        return None

    @property
    def virtual_time(self) -> bool:
        """Whether the backend's time only moves when told to (nothing can be timed on it)."""
        return False

    def control_refusal(self) -> str | None:
        """Why this process may not change these devices (``None``: as far as can be told, it may).

        One line naming what is missing and the ways out (docs/real-gpu.md §5). The default
        says nothing: the first write then tells. Root-only vendor backends check root and
        ``CAP_SYS_ADMIN`` (:func:`powerlib.privilege.admin_refusal`).
        """
        return None

    def close(self) -> None:
        """Release every device and library handle. Device settings are left as they are."""
        for dev in self.devices():
            dev.close()

    def __enter__(self) -> Backend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_PCI = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


def gpu_uuid_key(text: str) -> str:
    """A GPU UUID as compared across libraries (docs/real-gpu.md §4).

    NVML's ``GPU-<uuid>`` and torch's bare ``<uuid>`` are the same GPU.
    """
    return text.strip().lower().removeprefix("gpu-")


def normalize_pci(text: str) -> str | None:
    """``00000000:3b:00.0`` for any of ``0000:3B:00.0``, ``3b:00.0`` ...; None if not a bus id."""
    m = _PCI.match(text.strip().lower())
    if m is None:
        return None
    domain = int(m.group(1) or "0", 16)
    return f"{domain:08x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def match_device(devices: Sequence[Device], selector: int | str) -> Device | None:
    """The device ``selector`` names exactly: an index, a stable id (any case) or a PCI bus id.

    Never a prefix: code acting for someone else (the agent, a restore for a job) must not let
    a short or ambiguous selector pick another device. ``None`` when nothing matches.
    """
    text = str(selector).strip()
    if text.isdigit():
        index = int(text)
        return next((d for d in devices if d.index == index), None)
    folded = text.lower()
    exact = next((d for d in devices if d.device_id.lower() == folded), None)
    if exact is not None:
        return exact
    bus_id = normalize_pci(text)
    if bus_id is None:
        return None
    for dev in devices:
        pci = dev.details().get("pci_bus_id")
        if isinstance(pci, str) and normalize_pci(pci) == bus_id:
            return dev
    return None
