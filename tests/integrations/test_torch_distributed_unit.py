"""attach_pipeline / attach_module without processes: what they wrap, label and put back."""

from __future__ import annotations

import types

import pytest

from powerlib.errors import NotSupportedError
from powerlib.integrations.torch_distributed import attach_module, attach_pipeline


class _Recorder:
    def __init__(self, num_stages: int = 2, schedule: str = "1f1b") -> None:
        self.events: list[tuple] = []
        layout = types.SimpleNamespace(schedule=schedule)
        workload = types.SimpleNamespace(num_stages=num_stages, layout=layout)
        self.config = types.SimpleNamespace(workload=workload)
        self.layout: dict = {}

    def set_layout(self, **layout: object) -> None:
        self.layout = layout

    def begin(self, kind: str, microbatch: int = 0, chunk: int = 0) -> None:
        self.events.append(("begin", kind, microbatch, chunk))

    def end(self) -> None:
        self.events.append(("end",))

    def step(self) -> None:
        self.events.append(("step",))


class _Stage:
    def __init__(self, index: int) -> None:
        self.stage_index = index

    def forward_one_chunk(self, mb: int, args: tuple = (), kwargs: dict | None = None) -> str:
        return f"out{mb}"

    def backward_one_chunk(
        self, mb: int, loss: object = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        return None

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        return None


class _Multi:
    def __init__(self, stages: list[_Stage]) -> None:
        self._stages = stages
        self.pipeline_order = {
            0: [types.SimpleNamespace(computation_type=types.SimpleNamespace(value="F"))]
        }

    def step(self) -> None:
        # rank 0 of P=2 with chunks at stage indices 0 and 2
        by_index = {s.stage_index: s for s in self._stages}
        by_index[2].forward_one_chunk(0)
        by_index[0].forward_one_chunk(1)
        by_index[0].backward_one_chunk(1, full_backward=True)


def test_labels_chunks_by_stage_position_and_restores_the_methods() -> None:
    rec = _Recorder()
    schedule = _Multi([_Stage(2), _Stage(0)])  # unsorted on purpose
    with attach_pipeline(rec, schedule):
        schedule.step()
    assert rec.events == [
        ("begin", "forward", 0, 1),
        ("end",),
        ("begin", "forward", 1, 0),
        ("end",),
        ("begin", "backward", 1, 0),
        ("end",),
        ("step",),
    ]
    # two looped chunks: the generated 1F1B order cannot fit, so the recorded order is used
    assert rec.layout == {"schedule": "recorded", "num_chunks": 2, "placement": "looped"}
    for stage in schedule._stages:
        assert not {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"} & set(
            vars(stage)
        )
    assert "step" not in vars(schedule)
    rec.events.clear()
    schedule.step()
    assert rec.events == []  # detached


def test_split_backward_and_v_placement_are_labelled() -> None:
    rec = _Recorder(schedule="interleaved")
    schedule = _Multi([_Stage(3), _Stage(0)])  # rank 0 of P=2 in a V: stages 0 and 3
    schedule.pipeline_order = {
        0: [types.SimpleNamespace(computation_type=types.SimpleNamespace(value="W"))]
    }
    with attach_pipeline(rec, schedule):
        stage0, stage3 = sorted(schedule._stages, key=lambda s: s.stage_index)
        stage3.backward_one_chunk(2, full_backward=False)
        stage3.backward_weight_one_chunk(2)
        stage0.backward_one_chunk(1)
    assert rec.layout == {"schedule": "recorded", "num_chunks": 2, "placement": "v"}
    assert rec.events == [
        ("begin", "backward_input", 2, 1),
        ("end",),
        ("begin", "backward_weight", 2, 1),
        ("end",),
        ("begin", "backward", 1, 0),
        ("end",),
    ]


def test_stages_placed_neither_looped_nor_v_are_refused_before_anything_is_wrapped() -> None:
    schedule = _Multi([_Stage(0), _Stage(1)])  # P=2: rank 0 would hold 0 and 2 (or 0 and 3)
    with (
        pytest.raises(NotSupportedError, match="neither looped"),
        attach_pipeline(_Recorder(), schedule),
    ):
        pass
    assert "forward_one_chunk" not in vars(schedule._stages[0])


def test_not_a_schedule_and_disabled() -> None:
    with (
        pytest.raises(NotSupportedError, match="neither _stage nor _stages"),
        attach_pipeline(_Recorder(), object()),
    ):
        pass
    rec = _Recorder()
    schedule = _Multi([_Stage(0), _Stage(2)])
    with attach_pipeline(rec, schedule, enabled=False), attach_pipeline(None, schedule):
        schedule.step()
    assert rec.events == []


def test_module_hooks_label_accumulated_microbatches() -> None:
    torch = pytest.importorskip("torch")
    rec = _Recorder()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach_module(rec, model, opt):
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert rec.events == [
        ("begin", "forward", 0, 0),
        ("end",),
        ("begin", "backward", 0, 0),
        ("end",),
        ("begin", "forward", 1, 0),
        ("end",),
        ("begin", "backward", 1, 0),
        ("end",),
        ("step",),
    ]
    rec.events.clear()
    model(torch.randn(2, 4)).sum().backward()
    assert rec.events == []  # hooks removed
