"""The agent's wire protocol, ``powerlib.agent.v1``: JSON lines over a Unix stream socket.

One request per line, one response per line, in order (docs/agent.md §2)::

    {"v": 1, "id": 7, "op": "lock_sm_clocks", "device": "GPU-4f...", "min_mhz": 1200, "max_mhz": 1200}
    {"v": 1, "id": 7, "ok": true, "result": [1200.0, 1200.0]}
    {"v": 1, "id": 8, "ok": false, "error": {"type": "PermissionDeniedError", "message": "..."}}

A line longer than :data:`MAX_LINE_BYTES` is refused and the connection closed; so is a line that
is not a JSON object, names an unknown operation, or has arguments of the wrong type. The error
``type`` is the name of a :mod:`powerlib.errors` class, so the client raises what the agent's
backend raised.

This module is shared by the agent and its client and imports neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import powerlib.errors as errors
from powerlib.device import Capabilities, DeviceInfo, DeviceKind, PowerState

__all__ = [
    "MAX_LINE_BYTES",
    "OPERATIONS",
    "PROTOCOL",
    "VERSION",
    "ProtocolError",
    "decode_request",
    "encode",
    "error_from_wire",
    "error_reply",
    "error_to_wire",
    "info_from_wire",
    "info_to_wire",
    "one_line",
    "quote",
    "reply",
    "state_from_wire",
    "state_to_wire",
]

PROTOCOL = "powerlib.agent.v1"
VERSION = 1
MAX_LINE_BYTES = 64 * 1024
"""The longest request line the agent reads; a longer one closes the connection."""

READS = ("hello", "ping", "devices", "read", "leases")
"""Operations that change nothing (``read`` is authorized like a change: it names a device)."""
CHANGES = (
    "lock_sm_clocks",
    "reset_sm_clocks",
    "set_power_limit",
    "reset_power_limit",
    "release",
    "revoke",
)
"""Operations that change a device (``release`` restores it and ends the lease)."""
OPERATIONS = READS + CHANGES

_ARGS: Mapping[str, Mapping[str, tuple[type, ...]]] = {
    "hello": {},
    "ping": {},
    "devices": {},
    "leases": {},
    "read": {"device": (str, int)},
    "lock_sm_clocks": {"device": (str, int), "min_mhz": (int, float), "max_mhz": (int, float)},
    "reset_sm_clocks": {"device": (str, int)},
    "set_power_limit": {"device": (str, int), "power_limit_w": (int, float)},
    "reset_power_limit": {"device": (str, int)},
    "release": {"device": (str, int)},
    "revoke": {"job": (str,)},
}
_MAX_DEVICE_TEXT = 128
_MAX_ID_TEXT = 128
_MAX_INT_BITS = 64
"""An integer id or device index wider than this is refused (a 400-digit one included)."""
_NUMBERS = frozenset({"min_mhz", "max_mhz", "power_limit_w"})
_QUOTE_CHARS = 64


# A request that breaks the protocol: the agent answers it once and closes the connection. The
# class lives in powerlib.errors (in its __all__), so the wire names it and the client raises it.
ProtocolError = errors.ProtocolError


def encode(message: Mapping[str, Any]) -> bytes:
    """One JSON line (no NaN or infinity: they are not JSON)."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def decode_request(line: bytes) -> dict[str, Any]:
    """Parse and check one request line.

    Raises:
        ProtocolError: Not UTF-8 JSON, nested too deeply, not an object, wrong version,
            unknown operation, or an argument missing, extra or of the wrong type (``bool`` is
            not a number here), a number that is not finite as a float (a 400-digit integer),
            or an integer wider than 64 bits. Its message quotes what the client sent
            (:func:`quote`): one line, whatever the request held.
    """
    try:
        msg = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as err:
        raise ProtocolError(f"the request is not a JSON line: {err}") from None
    except RecursionError:  # [[[[... within the line cap: the decoder's own depth limit
        raise ProtocolError("the request is nested too deeply") from None
    if not isinstance(msg, dict):
        raise ProtocolError("the request is not a JSON object")
    if msg.get("v") != VERSION or isinstance(msg.get("v"), bool):
        raise ProtocolError(
            f"protocol version {quote(msg.get('v'))} is not supported (this agent speaks {VERSION})"
        )
    rid = msg.get("id")
    if rid is not None and (
        isinstance(rid, bool)
        or not isinstance(rid, (int, str))
        or (isinstance(rid, int) and rid.bit_length() > _MAX_INT_BITS)
        or (isinstance(rid, str) and len(rid) > _MAX_ID_TEXT)
    ):
        raise ProtocolError(
            f"id must be a 64-bit integer or a string of at most {_MAX_ID_TEXT} characters"
        )
    op = msg.get("op")
    if not isinstance(op, str) or op not in _ARGS:
        raise ProtocolError(f"unknown operation {quote(op)}; known: {', '.join(OPERATIONS)}")
    spec = _ARGS[op]
    extra = sorted(set(msg) - set(spec) - {"v", "id", "op"})
    if extra:
        shown = ", ".join(quote(k) for k in extra[:4])
        more = f" and {len(extra) - 4} more" if len(extra) > 4 else ""
        raise ProtocolError(f"{op}: unexpected argument(s) {shown}{more}")
    for name, types in spec.items():
        if name == "max_mhz" and name not in msg:
            continue  # optional: a single clock
        if name not in msg:
            raise ProtocolError(f"{op}: missing argument {name}")
        value = msg[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ProtocolError(f"{op}: {name} has the wrong type ({type(value).__name__})")
        if name in _NUMBERS and not (isinstance(value, int | float) and _finite(value)):
            raise ProtocolError(f"{op}: {name} must be a finite number")
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise ProtocolError(f"{op}: {name} is out of range")
        if isinstance(value, str) and not (0 < len(value) <= _MAX_DEVICE_TEXT):
            raise ProtocolError(f"{op}: {name} must be 1-{_MAX_DEVICE_TEXT} characters")
    return msg


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(value: float) -> bool:
    """Whether a number converts to a finite float (a 400-digit integer overflows)."""
    try:
        return math.isfinite(float(value))
    except (OverflowError, ValueError):
        return False


def quote(value: Any, limit: int = _QUOTE_CHARS) -> str:
    """A value a client sent, for a message: ``ascii()``-quoted and cut to ``limit`` characters.

    No newline or other control character of the client's reaches a log line or a reply
    (docs/agent.md §5); a huge integer or a container is named, not spelled out.
    """
    if isinstance(value, str):
        more = f"...({len(value)} characters)" if len(value) > limit else ""
        return ascii(value[:limit]) + more
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= _MAX_INT_BITS else "<a huge integer>"
    return f"<a JSON {type(value).__name__}>"


def one_line(text: str, limit: int = 2000) -> str:
    """A message for one log line: as is when printable, else ``ascii()``-escaped; bounded."""
    text = text if text.isprintable() else ascii(text)
    return text if len(text) <= limit else text[:limit] + "..."


# -- errors ----------------------------------------------------------------------------------------


def reply(rid: Any, result: Any) -> dict[str, object]:
    """A success response to request ``rid``."""
    return {"v": VERSION, "id": rid, "ok": True, "result": result}


def error_reply(rid: Any, err: BaseException) -> dict[str, object]:
    """An error response to request ``rid`` (``None``: the line could not be read)."""
    return {"v": VERSION, "id": rid, "ok": False, "error": error_to_wire(err)}


def error_to_wire(err: BaseException) -> dict[str, object]:
    """A powerlib error as ``{"type", "message", "device", "operation"}``."""
    if isinstance(err, errors.PowerlibError):
        return {
            "type": type(err).__name__ if type(err).__name__ in errors.__all__ else "DeviceError",
            "message": err.message,
            "device": err.device,
            "operation": err.operation,
        }
    return {"type": "DeviceError", "message": f"{type(err).__name__}: {err}"}


def error_from_wire(data: Any) -> errors.PowerlibError:
    """The client side: the same class the agent raised (``DeviceError`` for anything else)."""
    if not isinstance(data, Mapping):
        return errors.DeviceError(f"the agent sent a malformed error: {data!r}"[:300])
    name = data.get("type")
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, errors.PowerlibError)):
        cls = errors.DeviceError
    device = data.get("device")
    operation = data.get("operation")
    return cls(
        str(data.get("message", "the agent refused the request"))[:2000],
        device=device if isinstance(device, str) else None,
        operation=operation if isinstance(operation, str) else None,
    )


# -- devices and states ----------------------------------------------------------------------------


def info_to_wire(info: DeviceInfo, details: Mapping[str, Any]) -> dict[str, object]:
    """A device's static facts, plus its PCI bus id when the backend knows it."""
    out = asdict(info)
    out["kind"] = info.kind.value
    out["pci_bus_id"] = details.get("pci_bus_id")
    return out


def info_from_wire(data: Mapping[str, Any], backend: str) -> DeviceInfo:
    """Rebuild a :class:`DeviceInfo` (``backend`` names the client backend that shows it)."""
    caps = Capabilities(**{k: bool(v) for k, v in data["capabilities"].items()})
    limit = data.get("power_limit_range_w")
    return DeviceInfo(
        device_id=str(data["device_id"]),
        index=int(data["index"]),
        name=str(data["name"]),
        vendor=str(data["vendor"]),
        kind=DeviceKind(data["kind"]),
        backend=backend,
        supported_sm_freqs_mhz=tuple(float(f) for f in data["supported_sm_freqs_mhz"]),
        power_limit_range_w=None if limit is None else (float(limit[0]), float(limit[1])),
        default_power_limit_w=(
            None
            if data.get("default_power_limit_w") is None
            else float(data["default_power_limit_w"])
        ),
        capabilities=caps,
        is_simulated=bool(data.get("is_simulated", False)),
        supported_mem_freqs_mhz=tuple(float(f) for f in data.get("supported_mem_freqs_mhz", ())),
        power_sampling_duty=_duty(data.get("power_sampling_duty", 1.0)),
    )


def _duty(value: object) -> float:
    """The share of time the device's power is sampled; 1 from an agent that does not say.

    Raises:
        ValueError: Not a number in (0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"power_sampling_duty must be a number, not {value!r}")
    duty = float(value)
    if not 0.0 < duty <= 1.0:
        raise ValueError(f"power_sampling_duty must be in (0, 1], not {value!r}")
    return duty


def state_to_wire(state: PowerState) -> dict[str, object]:
    """A power-state snapshot (tuples become lists)."""
    out = asdict(state)
    for key, value in out.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
    return out


def state_from_wire(data: Mapping[str, Any]) -> PowerState:
    """Rebuild a :class:`PowerState`."""
    values = dict(data)
    for key, value in values.items():
        if isinstance(value, list):
            values[key] = tuple(value)
    return PowerState(**values)
