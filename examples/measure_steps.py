"""powerlib.measure around a training loop: energy per step, per token, and an eval window.

Run on simulated GPUs (the simulated work below stands in for a real step)::

    POWERLIB_BACKEND=simulated POWERLIB_SIM_GPUS=2 python examples/measure_steps.py --plot power.png

On real GPUs, drop the ``begin_work``/``end_work`` lines: the measurement reads the NVML (or
amdsmi, or RAPL) energy counters, and the loop is yours.
"""

from __future__ import annotations

import argparse
import json
import time

import powerlib
from powerlib.backends.simulated import SimulatedDevice
from powerlib.backends.simulated_model import WorkUnit


def fake_step(devices: list, seconds: float, activity: float) -> None:
    """Simulated GPUs busy for ``seconds`` (real GPUs: your forward, backward and step)."""
    for d in devices:
        if isinstance(d, SimulatedDevice):
            d.begin_work(WorkUnit(time_at_max_s=10.0, sm_activity=activity))
    time.sleep(seconds)
    for d in devices:
        if isinstance(d, SimulatedDevice):
            d.end_work()


def main() -> None:
    """Measure ten steps and an eval window; print the summary (``--json``: the whole result)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.3)
    ap.add_argument("--plot", help="draw power per device with the steps marked")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with powerlib.measure() as m:
        devices = m.devices
        time.sleep(0.3)  # the job loads its data
        for i in range(args.steps):
            with m.step(tokens=8 * 2048):  # tokens this rank processed in the step
                fake_step(devices, args.step_s, 0.95 if i % 2 else 0.8)
            time.sleep(0.05)  # data loading between steps: the GPUs idle
        with m.window("eval"):
            fake_step(devices, 0.6, 0.4)
        time.sleep(0.2)
    res = m.result()  # res = m.result(reduce="world") under torchrun: each GPU counted once
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        s = res.summary()
        print(
            f"{s['energy_j']:.0f} J in {s['time_s']:.2f} s ({s['average_power_w']:.0f} W); "
            f"{s['steps']} steps, {s['energy_per_step_j']:.1f} J/step, "
            f"{s['energy_per_token_j'] * 1e3:.3f} mJ/token; eval {res.window('eval')[0].energy_j:.0f} J"
        )
    if args.plot:
        from powerlib.measure_api.plot import plot_power  # noqa: PLC0415

        plot_power(m.power_series(), res, args.plot, title="examples/measure_steps.py")


if __name__ == "__main__":
    main()
