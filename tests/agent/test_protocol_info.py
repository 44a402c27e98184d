"""A device's facts over the agent's wire keep its power-sampling duty (issue 45)."""

from __future__ import annotations

import dataclasses

import pytest

from powerlib.agent import protocol
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
