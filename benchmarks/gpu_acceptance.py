"""One run that proves powerlib's clock-control path on a real GPU (issue 33, docs/real-gpu.md §9).

Run it as root on a node with one NVIDIA H100 or H200, the NVIDIA driver and CUDA torch::

    sudo python3 benchmarks/gpu_acceptance.py                 # GPU 0 (CUDA order)
    sudo python3 benchmarks/gpu_acceptance.py --device 1 --out /tmp/acceptance.json

It takes about five minutes (it adapts its longest part so that the whole run stays under eight)
and **changes the GPU's SM clock lock** hundreds of times. Every change goes through a
:class:`~powerlib.control.ControlSession`: journaled before it is made, restored at the end of
each part, on an exception, on SIGTERM/SIGHUP and at exit, and by a guardian process if the
script is killed with SIGKILL (``sudo powerlib restore`` puts back anything left). It never
changes a power limit. Run it on an otherwise idle GPU: its figures are the GPU's energy counter.

Seven parts, each with PASS/FAIL checks, each one module of ``benchmarks/acceptance/`` whose
docstring says what it measures and what it hands on to the next; the JSON (``--out``, default
``benchmarks/results/gpu_acceptance_<gpu>.json``) is rewritten after every part, so a run cut
short still leaves what it measured:

A. ``part_a_environment``: device, driver, permission; the cost of each read; the energy
   counter's period; a 10 ms on/off load against the counter; the default clock under load.
B. ``part_b_lock_readback``: the lock read back at six clocks under a steady bf16 matmul.
C. ``part_c_landing_latency``: switch landing latency, direct and through the runtime's
   controller.
D. ``part_d_profile``: a real per-instruction profile of a transformer-layer stack through
   ``powerlib.optimize(mode="profile")`` against a 3 s reference per kind and clock.
E. ``part_e_emulated_pipeline``: an 8-stage pipeline emulated from D's curves with A's, C's and
   D's measurements: the runtime's plan, predicted against realized.
F. ``part_f_apply``: one stage of E's plan applied on the GPU by a real
   ``powerlib.optimize(mode="apply")`` session in alternating blocks against all-max locked and
   the unlocked default.
G. ``part_g_restore``: the restore after exit and after a SIGKILL of a guarded child.

``acceptance/harness.py`` holds what they share (the report and its checks, the run's scale, the
rig, the loop around a part), ``acceptance/readings.py`` the device reads, ``acceptance/work.py``
the device opened and the work it runs. A part that fails or raises leaves a ``ran`` check and
the next part still runs. The script exits 1 when any check fails, 2 when it cannot start (no
GPU, no CUDA torch).

``--smoke`` runs every part on the simulated backend (NVML-like: a 50 ms counter, 0.5 ms reads,
20 ms +- 50 % clock latency, 1 % noise), CI-sized and without CUDA, in 20-30 s: four clocks,
0.15 s references, a 4-microbatch pipeline, 0.5 s blocks; the simulated GPU's work API stands
in for the matmul and the layers (the torch layer stack is only built and run once on the
CPU). Checks of powerlib's own mechanics (read-back, landing, apply, restore, guardian) are
judged there; checks whose figures would only restate the simulator's constants are recorded
with the status ``smoke``, never as a pass.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # imported (tests) rather than run as a script
    sys.path.insert(0, str(HERE))

from acceptance import (  # noqa: E402
    part_a_environment,
    part_b_lock_readback,
    part_c_landing_latency,
    part_d_profile,
    part_e_emulated_pipeline,
    part_f_apply,
    part_g_restore,
)
from acceptance.harness import Rig, run_part, use_smoke_environment  # noqa: E402
from acceptance.work import open_rig  # noqa: E402

# Each part: KEY, TITLE and run(rig, part), in the order they run (each hands on to the next).
PARTS = (
    part_a_environment,
    part_b_lock_readback,
    part_c_landing_latency,
    part_d_profile,
    part_e_emulated_pipeline,
    part_f_apply,
    part_g_restore,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON report (default: see above)")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument("--smoke", action="store_true", help="the simulated backend, CI-sized")
    parser.add_argument("--budget-s", type=float, help="the whole run's time (default 470 s)")
    return parser.parse_args(argv)


def run_parts(rig: Rig) -> None:
    """Parts A-G in order; then the script's control session ends and the JSON is final."""
    print(
        f"gpu_acceptance: {rig.dev.info.name} ({rig.dev.device_id}), "
        f"{'smoke run on the simulated backend' if rig.smoke else 'real run'}; "
        f"clocks {', '.join(f'{f:g}' for f in rig.freqs)} MHz; report {rig.report.path}",
        flush=True,
    )
    try:
        for part in PARTS:
            run_part(rig, part.KEY, part.TITLE, part.run)
    finally:
        rig.close()
        rig.report.save()
        rig.backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run parts A-G; 0 when every check passed, 1 when one failed, 2 when nothing could run."""
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp_name:
        tmp = Path(tmp_name)
        if args.smoke:
            use_smoke_environment(tmp)
        rig = open_rig(args, args.out, tmp, started)
        if isinstance(rig, str):
            print(f"gpu_acceptance: {rig}", file=sys.stderr)
            return 2
        if not rig.dev.info.capabilities.can_lock_sm_clocks:
            print(f"gpu_acceptance: {rig.dev.info.name} cannot lock its SM clock", file=sys.stderr)
            return 2
        run_parts(rig)
    print(rig.report.verdict_line(), flush=True)
    return 1 if rig.report.statuses().get("FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())
