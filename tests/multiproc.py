"""Launching one worker script per rank for the gloo end-to-end tests (tests/runtime, tests/integrations)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port nobody listens on right now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collapse(values: list[float]) -> list[float]:
    """Consecutive repeats removed: what a controller that skips no-op changes applies."""
    out: list[float] = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return out


def launch_ranks(worker: Path, args: list[str], world: int, state: Path) -> list[str]:
    """Run ``worker`` once per rank on gloo with simulated GPUs; returns each rank's output.

    Retries once with a new port if the rendezvous port was taken meanwhile. Fails the test,
    with the rank's output, if any rank exits non-zero.
    """
    for attempt in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_")} | {
            "POWERLIB_BACKEND": "simulated",
            "POWERLIB_SIM_GPUS": str(world),
            "POWERLIB_STATE_DIR": str(state),
            "POWERLIB_SIM_ENERGY_PERIOD_S": "0.001",  # per-instruction energy needs a fine counter
            # the workers' own Delay sleeps for the clock in force (tests/integrations/clocked.py):
            # the simulated GPU must not stretch the instructions a second time
            "POWERLIB_SIM_TIME_FOLLOWS_CLOCK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world),
            "PYTHONWARNINGS": "ignore",
        }
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), *args],
                env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        taken = any("EADDRINUSE" in log or "address already in use" in log.lower() for log in logs)
        if taken and attempt == 0:  # another process took the rendezvous port: not our bug
            continue
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
        return logs
    raise AssertionError("unreachable")
