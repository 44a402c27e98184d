"""The Megatron-core integration with megatron-core's real pipeline schedules on gloo.

Two processes (PP=2), simulated GPUs, megatron on CPU through the test-only shims of
``megatron_shims.py``. One launch runs both schedules (importing megatron-core costs seconds):
non-interleaved 1F1B and interleaved 1F1B (virtual pipeline size 2), M=4. For each, the session
profiles through the integration, rank 0 plans on the order the hooks recorded (which equals
powerlib's own generated schedule), every rank's requested and applied clocks in the first
managed iteration equal its stage of the plan, and a plan whose stage-1 order was tampered with
is caught on its first iteration (warn, reset, keep training). Each iteration also runs a
``forward_only`` evaluation pass, which must not disturb any of that. The in-process tests check
the glue against fakes: no-op when disabled, restore on exit, feature detection, refused paths,
and backward labels that follow the forward's output object.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from multiproc import collapse, launch_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
if not torch.distributed.is_gloo_available():
    pytest.skip("gloo is not available", allow_module_level=True)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import schedules  # noqa: E402

from powerlib.errors import NotSupportedError  # noqa: E402
from powerlib.integrations.megatron import attach  # noqa: E402
from powerlib.planning.pipeline import build_schedule  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.megatron]

WORKER = Path(__file__).with_name("megatron_worker.py")
WORLD = 2
M = 4
SCHEDULES = {"1f1b": 1, "interleaved": 2}  # name -> model chunks per rank


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("megatron")
    launch_ranks(WORKER, [str(tmp), *SCHEDULES], WORLD, tmp / "state")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_schedule_is_profiled_planned_and_applied(kind: str, results: list[dict]) -> None:
    chunks = SCHEDULES[kind]
    for rank, res in enumerate(results):
        auto = res[kind]["auto"]
        assert auto["warnings"] == [], auto["warnings"]
        assert auto["phase"] == "apply"
        assert auto["iterations"] == 6  # eval passes are not steps
        assert auto["order_source"] == "recorded"
        assert auto["applied_from"] == 4
        plan_freqs = [f for *_, f in auto["plan"]]
        assert auto["requested"] == auto["plan"]  # same instructions, same order, same clocks
        assert auto["applied_first_iteration"] == collapse(plan_freqs)
        assert auto["restored"] and auto["unpatched"]
        # megatron's executed order (recorded by the hooks) is powerlib's generated schedule
        generated = build_schedule(kind, WORLD, M, chunks)[rank]
        assert [(k, mb, c) for k, mb, c, _ in auto["plan"]] == [
            (i.kind, i.microbatch, i.chunk) for i in generated
        ]
    labels = {c for res in results for _, _, c, _ in res[kind]["auto"]["plan"]}
    assert labels == set(range(chunks))


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_wrong_order_is_caught_on_the_first_iteration(kind: str, results: list[dict]) -> None:
    mismatch = [res[kind]["mismatch"] for res in results]
    assert [len(m["warnings"]) for m in mismatch] == [0, 1]
    assert "does not run the plan's instruction order" in mismatch[1]["warnings"][0]
    assert [m["phase"] for m in mismatch] == ["apply", "done"]
    assert [m["iterations"] for m in mismatch] == [2, 2]  # training went on
    assert all(m["restored"] for m in mismatch)


def test_a_session_on_another_stage_is_refused(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for kind in SCHEDULES:
            message = res[kind]["wrong_stage"]
            assert f"pipeline rank {rank} of {WORLD}" in message, message


# -- in-process: the glue against fakes --------------------------------------------------------


class _Recorder:
    """A session stand-in that records the hook calls."""

    def __init__(self, stage: int = 0, num_stages: int = 1) -> None:
        self.stage = stage
        self.spec = types.SimpleNamespace(num_stages=num_stages)
        self.calls: list[tuple[Any, ...]] = []

    def begin(self, kind: str, microbatch: int = 0, chunk: int = 0) -> None:
        self.calls.append((kind, microbatch, chunk))

    def end(self) -> None:
        self.calls.append(("end",))

    def step(self) -> None:
        self.calls.append(("step",))


def _hooked_names() -> list[Any]:
    names = ("forward_step", "backward_step", "forward_backward_no_pipelining")
    names += ("forward_backward_pipelining_without_interleaving",)
    names += ("forward_backward_pipelining_with_interleaving",)
    return [getattr(schedules, n) for n in names]


def test_disabled_or_without_a_session_patches_nothing() -> None:
    before = _hooked_names()
    with attach(None):
        assert _hooked_names() == before
    with attach(_Recorder(), enabled=False):
        assert _hooked_names() == before


def test_originals_come_back_on_an_exception() -> None:
    before = _hooked_names()
    with pytest.raises(KeyError), attach(_Recorder()):
        assert schedules.forward_step is not before[0]
        raise KeyError("boom")
    assert _hooked_names() == before


def test_a_megatron_without_the_hooked_names_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(schedules, "backward_step")
    with pytest.raises(NotSupportedError, match=r"backward_step.*tested: 0\.16\.1"):
        with attach(_Recorder()):
            pass


def test_a_schedule_obtained_before_attach_is_refused_at_its_first_forward() -> None:
    with attach(_Recorder()), pytest.raises(NotSupportedError, match="inside the with block"):
        schedules.forward_step(None, None, None, 1, None, [], None, 1, current_microbatch=0)


@pytest.mark.parametrize(
    "config",
    [
        {"overlap_moe_expert_parallel_comm": True},
        {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},
    ],
)
def test_paths_the_hooks_cannot_see_are_refused(config: dict) -> None:
    model = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    session = _Recorder()
    with attach(session), pytest.raises(NotSupportedError, match="cannot follow"):
        schedules.get_forward_backward_func(1, None)(model=[model], forward_only=False)
    assert session.calls == []


def test_backward_labels_follow_the_forward_output_and_eval_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fake schedule in megatron's shape: list outputs, chunks, backwards in reverse order."""

    def fake_forward(*args: Any, current_microbatch: Any = None, vp_stage: Any = None, **kw: Any):
        return [object()], 0  # a new list, as forward_step returns for a list input

    def fake_backward(input_tensor: Any, output_tensor: Any, *args: Any) -> None:
        return None

    def fake_schedule(*, model: Any, forward_only: bool = False, **kwargs: Any) -> str:
        outs = [
            schedules.forward_step(None, current_microbatch=mb, vp_stage=chunk)[0]
            for mb, chunk in ((0, None), (1, None), (0, 1))
        ]
        if not forward_only:
            for out in reversed(outs):
                schedules.backward_step(None, out, None, None, None)
        return "losses"

    monkeypatch.setattr(schedules, "forward_step", fake_forward)
    monkeypatch.setattr(schedules, "backward_step", fake_backward)
    monkeypatch.setattr(schedules, "forward_backward_no_pipelining", fake_schedule)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", 0)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 1)
    session = _Recorder()
    with attach(session):
        func = schedules.get_forward_backward_func(1, None)
        assert func(model=None, forward_only=True) == "losses"  # eval: nothing recorded
        assert session.calls == []
        assert func(model=None) == "losses"
    hooks = [c for c in session.calls if c != ("end",)]
    assert hooks == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("B", 0, 1),
        ("B", 1, 0),
        ("B", 0, 0),
        ("step",),
    ]
    assert session.calls.count(("end",)) == 6
    assert schedules.forward_step is fake_forward  # restored to what it was at attach
