"""A device's facts over the agent's wire keep its power-sampling duty (issue 45)."""

from __future__ import annotations

import dataclasses

import pytest
from test_agent import Node
from test_agent import node as node  # noqa: F401 - the fixture, shared
from test_agent import root_dir as root_dir  # noqa: F401 - the fixture, shared

from powerlib import errors
from powerlib.agent import protocol
from powerlib.agent.client import AgentConnection
from powerlib.emulator.device import EmulatedDevice, VirtualTime


def _info(duty: float) -> object:
    table = {"forward": {1410.0: (0.05, 10.0), 1000.0: (0.06, 8.0)}}
    device = EmulatedDevice(index=0, table=table, clock=VirtualTime(), p_block_w=80.0, duty=duty)
    return device.info


def test_the_duty_goes_over_the_wire_and_an_old_agent_means_whole_period() -> None:
    info = _info(0.25)
    wire = protocol.info_to_wire(info, {})  # type: ignore[arg-type]
    back = protocol.info_from_wire(wire, backend="agent")
    assert back.power_sampling_duty == 0.25
    assert back == dataclasses.replace(info, backend="agent")  # type: ignore[type-var]
    del wire["power_sampling_duty"]  # an agent from before issue 45
    assert protocol.info_from_wire(wire, backend="agent").power_sampling_duty == 1.0


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "0.25", True, float("nan")])
def test_a_duty_out_of_range_is_refused(bad: object) -> None:
    wire = protocol.info_to_wire(_info(1.0), {})  # type: ignore[arg-type]
    wire["power_sampling_duty"] = bad
    with pytest.raises(ValueError, match="power_sampling_duty"):
        protocol.info_from_wire(wire, backend="agent")


# -- a broken request is a ProtocolError on the client too (issue 46, read-only finding) ----------


def test_a_protocol_error_crosses_the_wire_as_itself() -> None:
    """It used to travel as ``DeviceError``: its name was not in ``powerlib.errors.__all__``, so
    the agent sent "DeviceError" and the client raised that (exit code 10, not 7)."""
    assert "ProtocolError" in errors.__all__
    assert protocol.ProtocolError is errors.ProtocolError
    wire = protocol.error_to_wire(protocol.ProtocolError("read: device has the wrong type (bool)"))
    assert wire["type"] == "ProtocolError"
    back = protocol.error_from_wire(wire)
    assert type(back) is errors.ProtocolError
    assert isinstance(back, errors.InvalidArgumentError) and back.exit_code == 7
    assert back.message == "read: device has the wrong type (bool)"


def test_the_client_catches_the_agents_protocol_error(node: Node) -> None:
    """A real agent, a real client: a request the agent cannot take raises ProtocolError."""
    with AgentConnection(node.sock) as conn, pytest.raises(errors.ProtocolError) as caught:
        conn.call("read", device=True)  # a bool is no device index
    assert "read: device has the wrong type (bool)" in caught.value.message
    with AgentConnection(node.sock) as conn, pytest.raises(errors.ProtocolError, match="unknown"):
        conn.call("format_disk")
