"""The power-limit read-back the GPU backends share: set a limit, read it back, compare.

A driver may accept a power-limit write and keep another limit (a firmware clamp, a granularity,
a limit another agent holds): the NVIDIA and AMD backends each write through
:func:`write_power_limit`, which reads the limit back and refuses one that did not take effect.
"""

from __future__ import annotations

from collections.abc import Callable

from powerlib.errors import DeviceError

__all__ = ["READBACK_TOLERANCE_W", "write_power_limit"]

READBACK_TOLERANCE_W = 1.0
"""How far the limit read back may be from the one asked for (W): the drivers' granularity."""


def write_power_limit(
    power_limit_w: float,
    write: Callable[[], object],
    read_back: Callable[[], float | None],
    *,
    device_id: str,
    what: str = "power limit",
) -> float:
    """Write a power limit and check that it took effect.

    Args:
        power_limit_w: The limit to set, in W (already validated against the device's range).
        write: Writes it (the vendor call).
        read_back: The limit in force afterwards, in W; ``None`` when the driver does not say.
        device_id: Names the device in errors.
        what: How messages name the limit (``power cap`` on AMD).

    Returns:
        The limit read back.

    Raises:
        DeviceError: Nothing could be read back, or the limit read back differs from the one
            asked for by more than :data:`READBACK_TOLERANCE_W`.
    """
    op = "set_power_limit"
    write()
    readback_w = read_back()
    if readback_w is None:
        raise DeviceError(
            f"the {what} could not be read back after setting it", device=device_id, operation=op
        )
    if abs(readback_w - power_limit_w) > READBACK_TOLERANCE_W:
        raise DeviceError(
            f"the {what} did not take effect: asked {power_limit_w:g} W, the GPU reports "
            f"{readback_w:g} W",
            device=device_id,
            operation=op,
        )
    return readback_w
