"""Parse device-visibility variables (``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``, ...).

Shared by the NVIDIA and AMD backends so that "device 0 inside a job" is the GPU the framework
calls device 0. A token is an ordinal into the runtime's device order, or a device UUID
(``GPU-8932f937-...``) or a unique prefix of one. ``MIG-`` tokens name a slice of a GPU whose
clocks and power limit are shared by every tenant, so powerlib refuses to control them.
"""

from __future__ import annotations

from collections.abc import Sequence

from powerlib.errors import ConfigError

__all__ = ["select_visible"]


def _normalise(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-")


def select_visible(value: str | None, uuids: Sequence[str], variable: str) -> list[int]:
    """Positions in ``uuids`` (the runtime's device order) that ``value`` makes visible, in order.

    Args:
        value: The variable's value; ``None`` when unset (every device is visible), ``""`` when
            set empty (no device is visible).
        uuids: Device UUIDs in the runtime's ordinal order.
        variable: The variable's name, for error messages.

    Returns:
        Indices into ``uuids``, in the order the variable lists them.

    Raises:
        ConfigError: A token is out of range, matches no device or several, names a MIG
            instance, or repeats a device.
    """
    if value is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for raw in value.split(","):
        token = raw.strip()
        if not token:
            if value.strip():
                raise ConfigError(f"{variable}={value!r} has an empty entry")
            return []
        if token.upper().startswith("MIG-"):
            raise ConfigError(
                f"{variable} names the MIG instance {token}: clocks and power limits belong to the "
                "whole GPU and every MIG tenant shares them, so powerlib does not control MIG "
                "devices; list the physical GPU instead"
            )
        if token.lstrip("-").isdigit():
            ordinal = int(token)
            if not 0 <= ordinal < len(uuids):
                raise ConfigError(
                    f"{variable} entry {token} is out of range: {len(uuids)} GPU(s) present"
                )
            position = ordinal
        else:
            key = _normalise(token)
            matches = [i for i, u in enumerate(uuids) if _normalise(u).startswith(key)]
            if not matches:
                raise ConfigError(f"{variable} entry {token!r} matches no GPU's UUID")
            if len(matches) > 1:
                raise ConfigError(
                    f"{variable} entry {token!r} is ambiguous: it prefixes "
                    + ", ".join(uuids[i] for i in matches)
                )
            position = matches[0]
        if position in chosen:
            raise ConfigError(f"{variable} lists {uuids[position]} twice")
        chosen.append(position)
    return chosen
