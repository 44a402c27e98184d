"""One rank of the end-to-end test: a real torch 1F1B pipeline on gloo, driven through a session.

Launched by ``test_distributed.py`` once per rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` and ``POWERLIB_BACKEND=simulated`` (state shared through
``POWERLIB_STATE_DIR``). Each rank is one pipeline stage on its own simulated GPU. The stage is
a small linear layer; activations and gradients really travel between ranks with send/recv.
Compute-bound work slows at lower clocks on a real GPU; the simulated GPU does not run torch, so
each instruction also sleeps ``BASE_S * f_max / f`` for the clock in force.

Part 1 runs ``mode="auto"``: profile (3 clocks, each until its rows resolve), plan on rank 0,
apply. Part 2 applies a plan in
which rank 0 swapped two instructions of stage 1: stage 1 must warn once, reset and keep going.
Writes ``rank<R>.json`` with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import powerlib
from powerlib.planning.schedules import schedule_1f1b

BASE_S = 0.015  # well above a simulated clock change (~1 ms), so no request is superseded
MICROBATCHES = 4
FREQS = [1410.0, 1200.0, 1005.0]
TARGET_ERROR = 0.2  # wall-clock hooks on a loaded CPU: a looser target than the default 2 %
MAX_ITERATIONS_PER_FREQ = 4  # the session's default


def _state(device: powerlib.Device) -> dict:
    st = device.read_state()
    return {"locked": st.locked_sm_freqs_mhz, "power_limit_w": st.power_limit_w}


def main() -> int:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    layer = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    order = schedule_1f1b(world, MICROBATCHES)[rank]
    backend = powerlib.open_backend()
    device = backend.device(rank)
    f_max = device.info.max_sm_freq_mhz
    before = _state(device)

    def compute_delay() -> None:
        locked = device.read_state().locked_sm_freqs_mhz
        freq = locked[1] if locked else f_max
        time.sleep(BASE_S * f_max / freq)

    def iteration(session: powerlib.Session) -> None:
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        sends = []
        for ins in order:
            mb = ins.microbatch
            if ins.kind == "forward":
                if rank == 0:
                    x = torch.randn(8, 16)
                else:
                    x = torch.empty(8, 16)
                    dist.recv(x, src=rank - 1, tag=mb)
                    x.requires_grad_(True)
                with session.instruction("forward", microbatch=mb):
                    y = layer(x)
                    compute_delay()
                inputs[mb], outputs[mb] = x, y
                if rank < world - 1:
                    sends.append(dist.isend(y.detach(), dst=rank + 1, tag=mb))
            else:
                y, x = outputs.pop(mb), inputs.pop(mb)
                grad = None
                if rank < world - 1:
                    grad = torch.empty_like(y)
                    dist.recv(grad, src=rank + 1, tag=1000 + mb)
                with session.instruction("backward", microbatch=mb):
                    if grad is None:
                        y.pow(2).mean().backward()
                    else:
                        y.backward(grad)
                    compute_delay()
                if rank > 0:
                    sends.append(dist.isend(x.grad, dst=rank - 1, tag=1000 + mb))
        for work in sends:
            work.wait()
        opt.step()
        opt.zero_grad()
        session.step()

    result: dict = {"rank": rank, "before": before}
    # -- part 1: auto --------------------------------------------------------------------------
    marks = []
    recorder = warnings.catch_warnings(record=True)
    caught_auto = recorder.__enter__()
    warnings.simplefilter("always")
    with powerlib.optimize(
        num_stages=world,
        num_microbatches=MICROBATCHES,
        device=rank,
        freqs_mhz=FREQS,
        warmup_iterations=1,
        settle_iterations=0,
        iterations_per_freq=1,
        reference_iterations=1,  # these counts are exact: see runtime_helpers.EXACT_SWEEP
        rotating_reference=False,
        target_time_error=0.5,
        target_error=TARGET_ERROR,
        check_rounds=0,  # the closed loop has tests of its own
        out_dir=out / "auto",
    ) as session:
        assert session.controller is not None
        # the votes are collectives: every rank leaves the profile phase at the same iteration
        after = 2  # iterations run once the plan arrived
        for _ in range(1 + len(FREQS) * MAX_ITERATIONS_PER_FREQ + 1 + after):
            marks.append(len(session.controller.applied))
            iteration(session)
            session.controller.wait_idle()  # for the record only; the hooks never wait
            if session.phase != "profile":
                after -= 1
                if after == 0:
                    break
        marks.append(len(session.controller.applied))
        recorder.__exit__(None, None, None)
        for w in caught_auto:
            print(f"rank {rank} warning: {w.message}", file=sys.stderr, flush=True)
        assert session.plan is not None, "no plan was applied"
        first = session.apply_started_iteration
        applied = [c.freq_mhz for c in session.controller.applied]
        result["auto"] = {
            "phase": session.phase,
            "apply_started_iteration": first,
            "plan_freqs": session.plan.frequencies(rank),
            "requested": [f for _, f in session.first_apply_requests],
            "applied_first_iteration": applied[marks[first] : marks[first + 1]],
            "applied_ok": all(c.ok for c in session.controller.applied),
            "warnings": [str(w.message) for w in caught_auto],
        }
    result["after_auto"] = _state(device)

    # -- part 2: a plan whose stage-1 order the loop does not run --------------------------------
    tampered = out / "tampered.json"
    if rank == 0:
        data = json.loads((out / "auto" / "plan.json").read_text())
        ins = data["stages"][1]["instructions"]
        ins[0], ins[1] = ins[1], ins[0]
        tampered.write_text(json.dumps(data))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with powerlib.optimize(
            num_stages=world,
            num_microbatches=MICROBATCHES,
            device=rank,
            mode="apply",
            plan_path=tampered,
            check_rounds=0,
            out_dir=None,
        ) as session:
            for _ in range(2):
                iteration(session)
            result["mismatch"] = {"phase": session.phase}
    result["mismatch"]["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
    ]
    result["after_mismatch"] = _state(device)
    dist.barrier()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
