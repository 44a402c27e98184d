"""Hardware check for a real NVIDIA or AMD GPU. Skipped unless POWERLIB_HARDWARE_TESTS=1.

Run on a machine with the GPU, as root (setters need it), in well under a minute:

    POWERLIB_HARDWARE_TESTS=1 POWERLIB_BACKEND=nvidia python3 -m pytest tests/hardware -q
    POWERLIB_HARDWARE_TESTS=1 POWERLIB_BACKEND=amd    python3 -m pytest tests/hardware -q

POWERLIB_HARDWARE_DEVICE picks the device (default 0). The test reads everything, locks an SM
clock and checks it through the vendor library, sets a power limit and reads it back, then
restores both and checks the restore. Restores run in ``finally`` blocks, so a failing assertion
still leaves the GPU as it was (except that NVML cannot read back a clock lock that existed before
the test: it ends with clocks unlocked).
"""

from __future__ import annotations

import math
import os
import time

import pytest

from powerlib import DeviceKind, Settings, open_backend

# Captured at import: the suite's autouse fixture clears POWERLIB_* variables for each test.
_ENV = dict(os.environ)
_ENABLED = _ENV.get("POWERLIB_HARDWARE_TESTS") == "1"

pytestmark = [
    pytest.mark.hardware,
    pytest.mark.skipif(
        not _ENABLED, reason="set POWERLIB_HARDWARE_TESTS=1 on a machine with a GPU"
    ),
]


def test_read_lock_limit_restore_on_a_real_gpu() -> None:
    settings = Settings.from_env(_ENV)
    assert settings.backend in ("nvidia", "amd"), "set POWERLIB_BACKEND=nvidia or amd"
    with open_backend(settings=settings) as backend:
        dev = backend.device(int(_ENV.get("POWERLIB_HARDWARE_DEVICE", "0")))
        info = dev.info
        assert info.kind is DeviceKind.GPU and info.capabilities.can_lock_sm_clocks
        before = dev.read_state()
        for value in (
            before.power_w,
            before.sm_freq_mhz,
            before.power_limit_w,
            before.temperature_c,
        ):
            assert value is None or (math.isfinite(value) and value >= 0)
        assert before.power_w is not None and 10 < before.power_w < 2000
        assert before.energy_j is None or before.energy_j >= 0
        print(f"\n{info.name} {info.device_id}: {before}\ndetails: {dict(dev.details())}")

        freqs = info.supported_sm_freqs_mhz
        target_mhz = freqs[len(freqs) // 2]
        try:
            assert dev.lock_sm_clocks(target_mhz) == (target_mhz, target_mhz)
            time.sleep(1.0)  # let the clock settle
            locked = dev.read_state()
            details = dev.details()
            if info.backend == "nvidia":  # NVML has no getter for locks; the event reasons tell
                assert "clocks_locked_or_app_clocks" in (details["clock_event_reasons"] or [])
                assert locked.sm_freq_mhz is not None and locked.sm_freq_mhz <= target_mhz + 15
            else:
                assert locked.sm_freq_mhz is not None and locked.sm_freq_mhz <= target_mhz + 50
        finally:
            dev.reset_sm_clocks()

        limits = info.power_limit_range_w
        original_w = before.power_limit_w
        if limits is not None and original_w is not None and info.capabilities.can_set_power_limit:
            new_w = round(max(limits[0], min(limits[1], original_w * 0.8)))
            try:
                applied_w = dev.set_power_limit(new_w)
                assert abs(dev.read_state().power_limit_w - applied_w) <= 1.0
                assert abs(applied_w - new_w) <= 1.0
            finally:
                dev.set_power_limit(original_w)
            assert abs(dev.read_state().power_limit_w - original_w) <= 1.0

        time.sleep(1.0)
        after = dev.read_state()
        if info.backend == "nvidia":
            assert "clocks_locked_or_app_clocks" not in (dev.details()["clock_event_reasons"] or [])
        assert after.locked_sm_freqs_mhz is None
        if before.energy_j is not None:
            assert after.energy_j is not None and after.energy_j >= before.energy_j
