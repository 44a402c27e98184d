"""AMD GPUs through ``amdsmi`` (extra ``amd``).

This release ships the availability probe only. Importing ``amdsmi`` without ROCm prints to stdout
and raises ``KeyError``; with a library that lacks a symbol it raises ``AttributeError``. The import
here swallows the stdout noise (it would corrupt ``--json`` output) and turns every failure into
``BackendUnavailableError`` with a hint. Device control through amdsmi is tracked as issue #3.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from types import ModuleType
from typing import ClassVar

from powerlib.config import Settings
from powerlib.device import Backend, Device, ProbeResult
from powerlib.errors import BackendUnavailableError

__all__ = ["AmdBackend"]

INSTALL_HINT = (
    "install ROCm (libamd_smi.so) and its amdsmi Python wrapper, or pip install 'powerlib[amd]'"
)


def import_amdsmi() -> ModuleType:
    """Import ``amdsmi`` with its stdout noise captured.

    Raises:
        BackendUnavailableError: Not installed, or the ROCm library is missing or mismatched.
    """
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise):
            import amdsmi  # noqa: PLC0415 - lazy by design
    except ImportError as err:
        raise BackendUnavailableError(
            f"the amdsmi module is not installed: {INSTALL_HINT}"
        ) from err
    except (OSError, KeyError) as err:
        detail = noise.getvalue().strip().splitlines()
        raise BackendUnavailableError(
            "amdsmi cannot load libamd_smi.so"
            + (f" ({detail[0]})" if detail else "")
            + f": {INSTALL_HINT}; set ROCM_PATH if ROCm is installed elsewhere"
        ) from err
    except AttributeError as err:
        raise BackendUnavailableError(
            f"amdsmi does not match the installed libamd_smi.so ({err}); install the wrapper "
            "shipped with your ROCm (/opt/rocm/share/amd_smi)"
        ) from err
    return amdsmi


class AmdBackend(Backend):
    """AMD GPUs through amdsmi (probe only in this release; see the module docstring)."""

    name: ClassVar[str] = "amd"
    install_hint: ClassVar[str] = INSTALL_HINT

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        count = _count_gpus(import_amdsmi())
        raise BackendUnavailableError(
            f"amdsmi found {count} GPU(s), but device control through amdsmi is not available in "
            "this powerlib release yet (issue #3)"
        )

    @classmethod
    def probe(cls, settings: Settings) -> ProbeResult:
        """Import amdsmi, initialise it and count GPUs; never raises."""
        try:
            count = _count_gpus(import_amdsmi())
        except BackendUnavailableError as err:
            return ProbeResult(backend=cls.name, is_available=False, reason=err.message)
        return ProbeResult(
            backend=cls.name,
            is_available=False,
            reason=f"amdsmi found {count} GPU(s); amdsmi device control is not in this release yet (issue #3)",
        )

    def devices(self) -> Sequence[Device]:  # pragma: no cover - the constructor never succeeds yet
        """No devices until amdsmi control lands."""
        return ()


def _count_gpus(amdsmi: ModuleType) -> int:
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except Exception as err:  # amdsmi raises its own hierarchy; any failure means unavailable
        raise BackendUnavailableError(f"amdsmi_init failed: {err}") from err
    try:
        return len(amdsmi.amdsmi_get_processor_handles())
    finally:
        with contextlib.suppress(Exception):
            amdsmi.amdsmi_shut_down()
