"""Instruction energy: the counter when there is one, integrated power when there is not."""

from __future__ import annotations

import time

import pytest

from powerlib.device import Capabilities, Device, DeviceInfo, DeviceKind, PowerState
from powerlib.errors import NotSupportedError
from powerlib.kareus.energy_counter import EnergyMeter


class _PowerOnly(Device):
    """Reports power (a fixed value) but no energy counter."""

    def __init__(self, power_w: float | None) -> None:
        super().__init__(
            DeviceInfo(
                device_id="fake-0",
                index=0,
                name="power-only",
                vendor="test",
                kind=DeviceKind.GPU,
                backend="test",
                supported_sm_freqs_mhz=(),
                power_limit_range_w=None,
                default_power_limit_w=None,
                capabilities=Capabilities(
                    can_lock_sm_clocks=False,
                    can_set_power_limit=False,
                    can_reset_power_limit=False,
                    has_energy_counter=False,
                    has_power_reading=power_w is not None,
                    has_temperature=False,
                ),
            )
        )
        self.power_w = power_w

    def _read_state(self) -> PowerState:
        return PowerState(
            device_id="fake-0",
            timestamp_s=time.time(),
            power_w=self.power_w,
            energy_j=None,
            sm_freq_mhz=None,
            power_limit_w=None,
            temperature_c=None,
        )

    def _lock_sm_clocks(self, min_mhz: float, max_mhz: float) -> None:
        raise AssertionError

    def _reset_sm_clocks(self) -> None:
        raise AssertionError

    def _set_power_limit(self, power_limit_w: float) -> float:
        raise AssertionError

    def _reset_power_limit(self) -> None:
        raise AssertionError


def test_integrates_power_when_there_is_no_counter() -> None:
    now = [0.0]
    dev = _PowerOnly(200.0)
    meter = EnergyMeter(dev, clock=lambda: now[0], sample_period_s=0.001)
    try:
        assert meter.integrated
        e0 = meter.read_j()
        now[0] = 0.5
        assert meter.read_j() - e0 == pytest.approx(100.0)
        dev.power_w = 50.0
        time.sleep(0.05)  # the sampler sees the new power at t = 0.5
        now[0] = 1.5
        assert meter.read_j() - e0 == pytest.approx(150.0)
    finally:
        meter.close()


def test_refuses_a_device_without_energy_or_power() -> None:
    with pytest.raises(NotSupportedError, match="neither an energy counter nor power"):
        EnergyMeter(_PowerOnly(None))


def test_uses_the_counter_when_present() -> None:
    from powerlib.emulator.device import EmulatedDevice, VirtualTime

    clock = VirtualTime()
    dev = EmulatedDevice(
        index=0, table={"forward": {1410.0: (1.0, 300.0)}}, clock=clock, p_block_w=80.0
    )
    meter = EnergyMeter(dev, clock=clock)
    assert not meter.integrated
    e0 = meter.read_j()
    end, energy, _ = dev.execute("forward", 0.0)
    clock.now_s = end + 1.0
    assert meter.read_j() - e0 == pytest.approx(300.0 + 80.0)
