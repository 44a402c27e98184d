"""How fast the guardian puts devices back after its session is killed with SIGKILL.

Run::

    python3 benchmarks/guardian_restore.py --trials 20

Each trial, in a fresh temporary state directory on the simulated backend (two GPUs, wall clock,
state shared between processes through the state directory):

1. the parent captures both devices' SM clock lock and power limit;
2. a child process opens ``ControlSession(backend, guardian=True)``, locks both devices' clocks,
   sets their power limits, prints ``done`` and sleeps;
3. after ``--settle-s`` (so that the guardian has finished starting, as it has in a real job that
   runs for hours), the parent sends SIGKILL and polls the devices every ``--poll-s`` until they
   equal the captured state; no restore command is run.

Latency is the time from SIGKILL to the first poll that sees every device back. The script prints
one JSON object and exits 1 if any trial was not restored within ``--limit-s`` (2 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings

CHILD_CODE = """
import time
from powerlib.control import ControlSession
from powerlib.registry import open_backend

with open_backend() as backend, ControlSession(backend, guardian=True) as session:
    for dev in backend.devices():
        session.lock_sm_clocks(dev, 1005)
        session.set_power_limit(dev, 250)
    print("done", flush=True)
    time.sleep(60)
"""


def snapshot(settings: Settings) -> list[tuple[object, object]]:
    """Each device's SM clock lock and power limit."""
    with SimulatedBackend(settings) as backend:
        states = [dev.read_state() for dev in backend.devices()]
    return [(st.locked_sm_freqs_mhz, st.power_limit_w) for st in states]


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(pct / 100 * len(ordered)) - 1, 0)]


def one_trial(state_dir: Path, settle_s: float, poll_s: float, limit_s: float) -> float | None:
    """Run one SIGKILL trial; the restore latency in seconds, or ``None`` past ``limit_s``."""
    settings = Settings(backend="simulated", state_dir=state_dir, sim_gpus=2)
    with SimulatedBackend(settings) as backend:  # a non-default baseline to come back to
        backend.device(0).set_power_limit(320)
        backend.device(1).lock_sm_clocks(1200, 1410)
    before = snapshot(settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")}
    env.update(
        POWERLIB_BACKEND="simulated", POWERLIB_SIM_GPUS="2", POWERLIB_STATE_DIR=str(state_dir)
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_CODE], env=env, stdout=subprocess.PIPE, cwd=state_dir
    )
    assert child.stdout is not None
    try:
        if child.stdout.readline().strip() != b"done":
            raise RuntimeError(f"the child failed to start (exit code {child.wait()})")
        guardians = psutil.Process(child.pid).children()
        if snapshot(settings) == before:
            raise RuntimeError("the child changed nothing")
        time.sleep(settle_s)
        killed_at = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        latency_s = None
        while time.monotonic() - killed_at < limit_s:
            if snapshot(settings) == before:
                latency_s = time.monotonic() - killed_at
                break
            time.sleep(poll_s)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
    for guardian in guardians:  # the next trial starts from a quiet machine
        wait_exited(guardian)
    return latency_s


def wait_exited(proc: psutil.Process, timeout_s: float = 10.0) -> None:
    """Wait until ``proc`` has exited (a zombie counts: reaping orphans is init's business)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the guardian (pid {proc.pid}) did not exit in {timeout_s} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--poll-s", type=float, default=0.005)
    parser.add_argument("--limit-s", type=float, default=2.0)
    args = parser.parse_args()
    latencies: list[float | None] = []
    with tempfile.TemporaryDirectory(prefix="guardian-restore-") as tmp:
        for i in range(args.trials):
            state_dir = Path(tmp) / f"trial-{i}"
            state_dir.mkdir()
            latencies.append(one_trial(state_dir, args.settle_s, args.poll_s, args.limit_s))
    restored = [x for x in latencies if x is not None]
    result = {
        "benchmark": "guardian_restore",
        "trials": args.trials,
        "restored": len(restored),
        "latency_s": {
            "min": round(min(restored), 4),
            "median": round(statistics.median(restored), 4),
            "p90": round(percentile(restored, 90), 4),
            "max": round(max(restored), 4),
        }
        if restored
        else None,
        "all_restored": len(restored) == args.trials,
        "limit_s": args.limit_s,
        "settle_s": args.settle_s,
        "poll_s": args.poll_s,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}",
    }
    print(json.dumps(result, indent=2))
    return 0 if result["all_restored"] else 1


if __name__ == "__main__":
    sys.exit(main())
