"""Shared by the launch-control tests: a Kareus plan with every fallback, a recording launch."""

from __future__ import annotations

from typing import Any

from powerlib.kareus.launch import LaunchControl
from powerlib.planning.plan import PartitionSetting


def nb(**settings: tuple[str | None, int]) -> dict[str, Any]:
    return {
        "execution": "nanobatch",
        "overlap": {
            k: {"slot": s, "sm_count": n, "block_size": 1024} for k, (s, n) in settings.items()
        },
    }


def kareus_plan_data(num_stages: int = 1) -> dict[str, Any]:
    """Stage 0: F0 B0 F1 B1 with every fallback in it; other stages: a plain 1F1B with other SMs."""
    stage0 = [
        {
            "kind": "forward",
            "microbatch": 0,
            "freq_mhz": 1410.0,
            **nb(fwd_attn=("rope_0", 12), fwd_mlp=("norm_0", 6)),
        },
        {
            "kind": "backward",
            "microbatch": 0,
            "freq_mhz": 1200.0,
            **nb(fwd_attn=("linear_0", 9), fwd_mlp=("norm_0", 6), bwd_attn=("attn_0", 3)),
        },
        {"kind": "forward", "microbatch": 1, "freq_mhz": 1410.0},  # sequential
        {
            "kind": "backward",
            "microbatch": 1,
            "freq_mhz": 1200.0,
            **nb(
                fwd_attn=("rope_0", 12),
                fwd_mlp=("activation_0", 6),
                bwd_attn=("rope_0", 21),
                bwd_mlp=(None, 20),
            ),
        },
    ]
    stages = [{"stage": 0, "instructions": stage0}]
    for s in range(1, num_stages):
        stages.append(
            {
                "stage": s,
                "instructions": [
                    {
                        "kind": "forward",
                        "microbatch": 0,
                        "freq_mhz": 1410.0,
                        **nb(fwd_attn=("attn_0", 30)),
                    },
                    {
                        "kind": "backward",
                        "microbatch": 0,
                        "freq_mhz": 1410.0,
                        **nb(bwd_attn=("attn_0", 6)),
                    },
                    {
                        "kind": "forward",
                        "microbatch": 1,
                        "freq_mhz": 1410.0,
                        **nb(fwd_attn=("attn_0", 30)),
                    },
                    {
                        "kind": "backward",
                        "microbatch": 1,
                        "freq_mhz": 1410.0,
                        **nb(bwd_attn=("attn_0", 6)),
                    },
                ],
            }
        )
    return {
        "schema": "powerlib.plan.v1",
        "workload": {"num_stages": num_stages, "num_microbatches": 2, "schedule": "1f1b"},
        "policy": "min-energy",
        "stages": stages,
    }


ORDER = [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]


class Recorder:
    """A ``launch`` callback that records its calls and hands back a waitable handle."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, PartitionSetting | None, str | None]] = []
        self.events: list[str] = []
        self.at: str | None = None

    def __call__(self, group: Any, setting: PartitionSetting | None) -> Any:
        self.calls.append((group, setting, self.at))
        self.events.append("launch")
        recorder = self

        class Work:
            def wait(self) -> None:
                recorder.events.append("wait")

        return Work()


def run_partition(
    control: LaunchControl, key: str, slots: list[str], rec: Recorder, group: Any = None
) -> None:
    with control.partition(key, launch=rec, group=group) as part:
        for slot in slots:
            rec.at = slot
            part.slot(slot)
            rec.events.append(f"compute {slot}")
        rec.at = "exit"


ATTN = ["norm_0", "linear_0", "rope_0", "attn_0", "linear_1"]
MLP = ["norm_0", "linear_0", "activation_0", "linear_1"]
