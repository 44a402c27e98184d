"""A training job for the dashboard test: an in-process Exporter with a measurement and sessions.

Run with ``POWERLIB_BACKEND=simulated`` and a private ``POWERLIB_STATE_DIR``; argv[1] is a
folder for the sessions' output. It

* locks GPU 0's clocks on the simulated backend (as an optimizing job does), so the node's
  ``powerlib exporter`` serves the locked-clock series;
* runs four optimizing sessions (``powerlib.optimize``'s Session, an emulated 4-stage pipeline)
  through profile, plan, apply and the closed loop's verdict, and keeps them open;
* serves ``Exporter([], port=0)`` (sessions and measurements only) and prints ``port N``;
* runs ``powerlib.measure`` steps on the simulated GPU 0 until stdin closes, SIGTERM, or 120 s.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: runtime_helpers

from runtime_helpers import emulated_sessions, make_emulator, toy_profile  # noqa: E402

import powerlib  # noqa: E402
from powerlib.backends.simulated_model import WorkUnit  # noqa: E402
from powerlib.exporter import Exporter  # noqa: E402

LIMIT_S = 120.0  # an orphaned job never outlives its test for long


def main() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def watch_stdin() -> None:
        sys.stdin.read()  # returns at EOF: the test closed the pipe or died
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    backend = powerlib.open_backend()
    gpu = backend.devices()[0]
    gpu.lock_sm_clocks(1005.0, 1410.0)
    emulator = make_emulator(toy_profile(), 4)
    sessions = emulated_sessions(emulator, Path(sys.argv[1]), settle_iterations=0, check_rounds=3)
    with contextlib.ExitStack() as stack:
        for s in sessions:
            stack.enter_context(s)
        for _ in range(300):
            emulator.run_iteration(sessions)
            if sessions[0].realized is not None:
                break
        if sessions[0].realized is None or sessions[0].realized.rounds == 0:
            sys.exit(f"the sessions reached no measured verdict: {sessions[0].realized}")
        exp = stack.enter_context(Exporter([], port=0, addr="127.0.0.1"))
        m = stack.enter_context(powerlib.measure([gpu], backend=backend))
        print(f"port {exp.port}", flush=True)
        deadline = time.monotonic() + LIMIT_S
        while not stop.is_set() and time.monotonic() < deadline:
            with m.step(tokens=256):
                gpu.begin_work(WorkUnit(time_at_max_s=1.0, sm_activity=0.9))
                time.sleep(0.05)
                gpu.end_work()
    backend.close()


if __name__ == "__main__":
    main()
