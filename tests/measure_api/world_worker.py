"""One rank of the reduce="world" test: gloo, simulated GPUs shared through the state directory.

argv[1]: ``shared`` (every rank measures every GPU, as eight ranks that each see a node's eight
GPUs do) or ``own`` (each rank measures its LOCAL_RANK GPU). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

import powerlib
from powerlib.backends.simulated_model import WorkUnit


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = powerlib.open_backend()
    mine = backend.devices()[int(os.environ["LOCAL_RANK"])]
    devices = None if mode == "shared" else [mine]
    with powerlib.measure(devices, backend=backend, sample_period_s=0.005) as m:
        for _ in range(4):
            dist.barrier()
            with m.step(tokens=100 * (rank + 1)):
                mine.begin_work(WorkUnit(time_at_max_s=1.0, sm_activity=0.9))
                time.sleep(0.1)
                mine.end_work()
        dist.barrier()
    world = m.result(reduce="world")
    world_max = m.result(reduce="world", tokens_reduce="max")
    locals_ = [None] * dist.get_world_size()
    dist.all_gather_object(locals_, m.result().to_json(windows=False))
    if rank == 0:
        print(
            json.dumps(
                {
                    "world": world.to_json(),
                    "tokens_max": world_max.tokens,
                    "locals": locals_,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
