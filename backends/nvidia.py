"""NVIDIA GPUs through NVML (the ``pynvml`` module of ``nvidia-ml-py``, extra ``nvidia``).

This release ships the availability probe only: it imports the binding lazily, initialises NVML and
counts GPUs, and says precisely what is missing when it cannot. Device control through NVML is
tracked separately (issue #3); until then an NVIDIA machine reports NVML as found but not yet
controllable, and ``auto`` moves on to the next backend.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import ClassVar

from powerlib.config import Settings
from powerlib.device import Backend, Device, ProbeResult
from powerlib.errors import BackendUnavailableError

__all__ = ["NvidiaBackend"]

INSTALL_HINT = "pip install 'powerlib[nvidia]' (nvidia-ml-py) and an NVIDIA driver"


def import_pynvml() -> ModuleType:
    """Import NVIDIA's ``pynvml`` module, silencing the deprecated ``pynvml`` shim's warning.

    Raises:
        BackendUnavailableError: The module is not installed, or is not NVIDIA's binding.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
            import pynvml  # noqa: PLC0415 - lazy by design
    except ImportError as err:
        raise BackendUnavailableError(
            f"the pynvml module is not installed: {INSTALL_HINT}"
        ) from err
    if not hasattr(pynvml, "_nvmlGetFunctionPointer"):
        raise BackendUnavailableError(
            f"the installed pynvml module ({getattr(pynvml, '__file__', '?')}) is not NVIDIA's "
            "nvidia-ml-py binding; uninstall nvidia-ml-py3/py3nvml and pip install nvidia-ml-py"
        )
    return pynvml


@contextlib.contextmanager
def _nvml_session(pynvml: ModuleType) -> Iterator[int]:
    """Initialise NVML, yield the GPU count, shut NVML down."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        code = getattr(err, "value", None)
        if code == getattr(pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
            reason = "libnvidia-ml.so.1 not found: install the NVIDIA driver"
        elif code == getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
            reason = "the NVIDIA kernel driver is not loaded"
        elif code == getattr(pynvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", 18):
            reason = "NVML and kernel driver versions differ (driver upgraded without a reboot?)"
        else:
            reason = f"nvmlInit failed: {err}"
        raise BackendUnavailableError(reason, vendor_code=code) from err
    try:
        yield int(pynvml.nvmlDeviceGetCount())
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class NvidiaBackend(Backend):
    """NVIDIA GPUs through NVML (probe only in this release; see the module docstring)."""

    name: ClassVar[str] = "nvidia"
    install_hint: ClassVar[str] = INSTALL_HINT

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        pynvml = import_pynvml()
        with _nvml_session(pynvml) as count:
            pass
        raise BackendUnavailableError(
            f"NVML found {count} GPU(s), but device control through NVML is not available in "
            f"this powerlib release yet (issue #3)"
        )

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Import the binding, initialise NVML and count GPUs; never raises."""
        try:
            with _nvml_session(import_pynvml()) as count:
                pass
        except BackendUnavailableError as err:
            return ProbeResult(backend=cls.name, is_available=False, reason=err.message)
        return ProbeResult(
            backend=cls.name,
            is_available=False,
            reason=f"NVML found {count} GPU(s); NVML device control is not in this release yet (issue #3)",
        )

    def devices(self) -> Sequence[Device]:  # pragma: no cover - the constructor never succeeds yet
        """No devices until NVML control lands."""
        return ()
