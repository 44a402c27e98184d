"""One rank of the launch-control test: two gloo ranks, one tensor-parallel group, a 1-stage job.

Launched by ``test_launch.py`` (``tests/multiproc.launch_ranks``) with the plan file and an output
folder. The session applies the plan (``mode="apply"``, simulated GPU) and drives Kareus's launch
control (attached before the ``with`` block) from its instruction hooks. Each instruction runs two layers of Kareus-style partitions
(forward: attention and MLP; backward: the recomputed forward partitions, then the backward
ones); every partition announces its launch slots, does some CPU matmuls per slot, and its
collective is a real asynchronous ``all_reduce`` launched from the launch control's callback.
After the partition's join the reduced tensor must equal the sum over ranks. Writes
``rank<R>.json``: the runtime's launch records next to the slot the worker itself saw each launch
happen at, the runtime's report, and whether every all-reduce was correct.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import powerlib
from powerlib.kareus.launch import LaunchControl, attach

LAYERS = 2
ITERATIONS = 2
SLOTS = {
    "fwd_attn": ["norm_0", "linear_0", "rope_0", "attn_0", "linear_1"],
    "fwd_mlp": ["norm_0", "linear_0", "activation_0", "linear_1"],
    "bwd_mlp": ["norm_0", "linear_0", "activation_0", "linear_1"],
    "bwd_attn": ["norm_0", "linear_0", "attn_0", "rope_0", "linear_1"],
}
PARTITIONS = {
    "forward": ["fwd_attn", "fwd_mlp"],
    "backward": ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"],  # recompute, then backward
}
ORDER = [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]


def main() -> int:
    plan_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(
        1
    )  # two ranks on a shared CPU: no thread pools spinning against each other
    torch.manual_seed(0)
    weight = torch.randn(32, 32) / 8
    state: dict[str, Any] = {"slot": None, "checked": 0, "correct": True, "slots": []}

    def partition(control: LaunchControl, key: str, seed: int) -> None:
        base = torch.arange(64, dtype=torch.float32) + seed
        buf = base * (rank + 1)  # this rank's contribution: sum over ranks is base * 3

        def launch(group: Any, setting: Any) -> Any:
            state["slots"].append(state["slot"])
            return dist.all_reduce(buf, group=group, async_op=True)

        x = torch.randn(16, 32)
        state["slot"] = None
        with control.partition(key, launch=launch) as part:
            for slot in SLOTS[key]:
                state["slot"] = slot
                part.slot(slot)
                x = torch.tanh(x @ weight)  # the slot's compute, overlapping the collective
            state["slot"] = None  # a launch from here on happens at partition exit
        expected = base * sum(r + 1 for r in range(world))
        state["checked"] += 1
        state["correct"] = state["correct"] and bool(torch.equal(buf, expected))

    session = powerlib.optimize(
        num_stages=1,
        num_microbatches=2,
        stage=0,
        mode="apply",
        plan_path=plan_path,
        out_dir=None,
        progress=False,
    )
    control = attach(session)
    with session:
        seed = 0
        for _ in range(ITERATIONS):
            for kind, mb in ORDER:
                with session.instruction(kind, microbatch=mb):
                    for _layer in range(LAYERS):
                        for key in PARTITIONS[kind]:
                            seed += 1
                            partition(control, key, seed)
            session.step()
        records = [
            r.to_json() | {"worker_slot": s} for r, s in zip(control.records, state["slots"])
        ]
        report = control.report().to_json()
        assert len(records) == len(state["slots"]) == state["checked"]
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "records": records,
                "report": report,
                "checked": state["checked"],
                "all_correct": state["correct"],
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
