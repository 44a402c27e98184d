"""Backend registry: which backend to open, and why.

Precedence: an explicit ``name`` argument > ``Settings.backend`` (``POWERLIB_BACKEND``) > ``auto``.
``auto`` probes nvidia → amd → sysfs and takes the first that is available; it never picks
``simulated``. A backend named explicitly that cannot start raises ``BackendUnavailableError``
naming what to install — there is no silent fallback.

The registry stores import strings, so choosing one backend never imports the others (or their
vendor libraries). Third parties add backends through the ``powerlib.backends`` entry-point group::

    [project.entry-points."powerlib.backends"]
    mygpu = "mypkg.powerlib_backend:MyGpuBackend"

The class must subclass :class:`powerlib.backend.Backend`. Built-in names cannot be shadowed.

``agent`` sends every change to the node agent (docs/agent.md) and reads through it too;
``agent:NAME`` (``agent:nvidia``) sends changes to the agent and reads locally through ``NAME``,
which needs no privilege.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from powerlib.backend import Backend, ProbeResult, gpu_uuid_key
from powerlib.config import Settings
from powerlib.device import Device
from powerlib.errors import BackendUnavailableError, ConfigError, DeviceNotFoundError

if TYPE_CHECKING:
    from importlib import metadata

__all__ = [
    "AUTO_ORDER",
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "backend_names",
    "check_backend_name",
    "load_backend_class",
    "local_device",
    "open_backend",
    "probe_backends",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "powerlib.backends"

BUILTIN_BACKENDS: Mapping[str, str] = {
    "nvidia": "powerlib.backends.nvidia:NvidiaBackend",
    "amd": "powerlib.backends.amd:AmdBackend",
    "sysfs": "powerlib.backends.sysfs:SysfsBackend",
    "simulated": "powerlib.backends.simulated:SimulatedBackend",
    "agent": "powerlib.backends.agent:AgentBackend",
}

AUTO_ORDER: tuple[str, ...] = ("nvidia", "amd", "sysfs")


def _plugin_entry_points() -> dict[str, metadata.EntryPoint]:
    # Imported here: importlib.metadata costs 13 ms, and a built-in backend never needs it.
    from importlib import metadata  # noqa: PLC0415 - only when plug-ins are looked up (13 ms)

    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_BACKENDS or ep.name == "auto":
            logger.warning(
                "ignoring plug-in backend %r from %s: the name is reserved", ep.name, ep.value
            )
            continue
        found.setdefault(ep.name, ep)
    return found


def backend_names() -> dict[str, str]:
    """Every known backend name mapped to its import string (built-ins first, then plug-ins)."""
    names = dict(BUILTIN_BACKENDS)
    names.update({name: ep.value for name, ep in sorted(_plugin_entry_points().items())})
    return names


def check_backend_name(name: str) -> None:
    """Refuse a name that is neither ``auto``, a built-in nor a registered plug-in.

    Raises:
        ConfigError: The message lists the valid names.
    """
    if name == "auto" or name in BUILTIN_BACKENDS:
        return
    if name.startswith("agent:"):  # the agent, reading locally through another backend
        inner = name.partition(":")[2]
        if inner in ("agent", "auto") or inner.startswith("agent:"):
            raise ConfigError(f"backend {name!r}: agent:NAME reads through NAME, a device backend")
        check_backend_name(inner)
        return
    names = backend_names()
    if name not in names:
        valid = ", ".join(["auto", *names])
        raise ConfigError(f"unknown backend {name!r}; valid names: {valid}")


def load_backend_class(name: str) -> type[Backend]:
    """Import the backend class registered as ``name``.

    Raises:
        ConfigError: No backend has that name (the message lists the valid names).
        BackendUnavailableError: A plug-in's module cannot be imported.
    """
    if name.startswith("agent:"):
        check_backend_name(name)
        name = "agent"
    if name in BUILTIN_BACKENDS:
        target = BUILTIN_BACKENDS[name]
    else:
        check_backend_name(name)
        target = _plugin_entry_points()[name].value
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise BackendUnavailableError(
            f"backend {name!r} could not be loaded from {target}: {err}"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendUnavailableError(
            f"backend {name!r} ({target}) is not a powerlib.backend.Backend subclass"
        )
    return cls


def _safe_probe(name: str, settings: Settings) -> ProbeResult:
    try:
        return load_backend_class(name).probe(settings)
    except Exception as err:  # noqa: BLE001 - a broken plug-in must not break `powerlib env`
        return ProbeResult(backend=name, is_available=False, reason=f"probe failed: {err}")


def probe_backends(settings: Settings, names: Iterable[str] | None = None) -> list[ProbeResult]:
    """Probe backends (the ``auto`` order by default) and say why each is or is not usable."""
    return [_safe_probe(name, settings) for name in (AUTO_ORDER if names is None else names)]


def open_backend(name: str | None = None, settings: Settings | None = None) -> Backend:
    """Open a backend.

    Args:
        name: Backend name or ``"auto"``; defaults to ``settings.backend``.
        settings: Defaults to :meth:`Settings.from_env`.

    Returns:
        The opened backend; close it (or use it as a context manager) when done.

    Raises:
        ConfigError: Unknown backend name.
        BackendUnavailableError: The backend cannot start, or ``auto`` found nothing; the message
            says what is missing for each candidate.
    """
    settings = Settings.from_env() if settings is None else settings
    chosen = settings.backend if name is None else name
    if chosen != "auto":
        cls = load_backend_class(chosen)
        if chosen != settings.backend:  # agent:NAME reads which backend from its settings
            settings = dataclasses.replace(settings, backend=chosen)
        backend = cls(settings)
        logger.info("opened backend %s with %d device(s)", chosen, len(backend.devices()))
        return backend
    probes = probe_backends(settings)
    for probe in probes:
        if probe.is_available:
            backend = load_backend_class(probe.backend)(settings)
            logger.info("auto-selected backend %s: %s", probe.backend, probe.reason)
            return backend
        logger.debug("auto: skipped %s: %s", probe.backend, probe.reason)
    skipped = "; ".join(f"{p.backend}: {p.reason}" for p in probes)
    raise BackendUnavailableError(
        f"no power backend available ({skipped}); "
        "set POWERLIB_BACKEND=simulated to use simulated GPUs"
    )


def _cuda_uuid() -> str | None:
    """The UUID of this process's CUDA device, when torch has CUDA up (never on ROCm)."""
    torch = sys.modules.get("torch")  # never import torch: a CPU job does not have it
    if torch is None or getattr(getattr(torch, "version", None), "hip", None):
        return None  # AMD: HIP's UUIDs are not amdsmi's ids; the index decides
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
    except Exception as err:  # noqa: BLE001 - a broken CUDA leaves the choice to the index
        logger.info("powerlib: could not read the CUDA device's UUID: %s", err)
        return None
    return gpu_uuid_key(str(uuid)) or None


def local_device(backend: Backend, settings: Settings) -> Device:
    """This process's device of ``backend`` when none is named (docs/real-gpu.md §4).

    In order: the device whose id is the UUID of torch's current CUDA device (when CUDA is
    initialised; NVML ids are ``GPU-<uuid>``); ``LOCAL_RANK`` (else 0) as an index among the
    visible devices when it is in range; the only visible device (a launcher that gives each
    process one GPU through ``CUDA_VISIBLE_DEVICES``).

    Raises:
        DeviceNotFoundError: None of these applies; the message names ``LOCAL_RANK``,
            ``CUDA_VISIBLE_DEVICES`` and the visible devices.
    """
    devices = list(backend.devices())
    uuid = _cuda_uuid()
    if uuid is not None:
        for device in devices:
            if gpu_uuid_key(device.device_id) == uuid:
                return device
        logger.info(
            "powerlib: the CUDA device's UUID %s is not among the %s backend's devices; "
            "choosing by LOCAL_RANK",
            uuid,
            backend.name,
        )
    index = settings.local_rank or 0
    if 0 <= index < len(devices):
        return devices[index]
    if len(devices) == 1:
        logger.info(
            "powerlib: LOCAL_RANK=%s but one device is visible (CUDA_VISIBLE_DEVICES=%s): using %s",
            settings.local_rank,
            settings.cuda_visible_devices,
            devices[0].device_id,
        )
        return devices[0]
    visible = (
        "unset" if settings.cuda_visible_devices is None else repr(settings.cuda_visible_devices)
    )
    rank = "unset" if settings.local_rank is None else settings.local_rank
    raise DeviceNotFoundError(
        f"no device for LOCAL_RANK={rank}: the {backend.name} backend sees "
        f"{len(devices)} device(s) (CUDA_VISIBLE_DEVICES {visible}); pass device= or give "
        "each process its GPU through CUDA_VISIBLE_DEVICES"
    )
