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
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
from multiproc import collapse, launch_ranks

torch = pytest.importorskip("torch")
megatron_core = pytest.importorskip("megatron.core")
if not torch.distributed.is_gloo_available():
    pytest.skip("gloo is not available", allow_module_level=True)

from clocked import (  # noqa: E402
    APPLIED_ITERATIONS,
    FREQS,
    MAX_PROFILE_ITERATIONS,
    SWEEP,
    assert_profiled_then_applied,
)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import schedules  # noqa: E402

from powerlib.errors import InvalidArgumentError, NotSupportedError  # noqa: E402
from powerlib.integrations import megatron as integration  # noqa: E402
from powerlib.integrations.megatron import attach, patch_training  # noqa: E402
from powerlib.planning.schedules import build_schedule  # noqa: E402

try:
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.training import training as megatron_training  # megatron-core 0.17+
except ImportError:
    megatron_training = None
needs_training = pytest.mark.skipif(
    megatron_training is None, reason="megatron.training ships with megatron-core 0.17+ only"
)

pytestmark = [pytest.mark.integration, pytest.mark.megatron]

WORKER = Path(__file__).with_name("megatron_worker.py")
GPT_WORKER = Path(__file__).with_name("megatron_gpt_worker.py")
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
        assert auto["order_source"] == "recorded"
        assert_profiled_then_applied(auto)  # one step per iteration: eval passes are not steps
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
        self.config = types.SimpleNamespace(workload=types.SimpleNamespace(num_stages=num_stages))
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
    with pytest.raises(NotSupportedError, match=r"backward_step.*tested: megatron-core 0\.16\.1"):
        with attach(_Recorder()):
            pass


def test_a_schedule_obtained_before_attach_is_refused_at_its_first_forward() -> None:
    with attach(_Recorder()), pytest.raises(NotSupportedError, match="inside the with block"):
        schedules.forward_step(None, None, None, 1, None, [], None, 1, current_microbatch=0)


@pytest.mark.parametrize(
    "config",
    [
        {"overlap_moe_expert_parallel_comm": True},
        {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},  # 0.16-0.17
        {"cuda_graph_impl": "full_iteration"},  # 0.18+
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


def test_mimo_backward_is_labelled_by_the_forward_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi-module (MIMO) path: the 1F1B schedule binds ``backward_step_multimodule`` by
    name into a ``functools.partial`` at call time (megatron-core 0.17+), outputs are dicts."""
    import functools

    def fake_forward(*args: Any, current_microbatch: Any = None, vp_stage: Any = None, **kw: Any):
        return {"vision": object(), "language": object()}, 0

    def fake_multimodule(
        input_tensor: Any,
        output_tensor: Any,
        grad: Any,
        config: Any,
        language_model_module_name: str,
    ) -> dict:
        assert language_model_module_name == "language"
        return {}

    def fake_schedule(*, model: Any, forward_only: bool = False, **kwargs: Any) -> None:
        backward = functools.partial(
            schedules.backward_step_multimodule, language_model_module_name="language"
        )
        outs = [schedules.forward_step(None, current_microbatch=mb)[0] for mb in (0, 1)]
        for out in outs:
            backward({}, out, None, None)

    monkeypatch.setattr(schedules, "forward_step", fake_forward)
    monkeypatch.setattr(schedules, "backward_step_multimodule", fake_multimodule, raising=False)
    monkeypatch.setattr(schedules, "forward_backward_no_pipelining", fake_schedule)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", 0)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 1)
    session = _Recorder()
    with attach(session):
        schedules.get_forward_backward_func(1, None)(model=None)
    assert [c for c in session.calls if c != ("end",)] == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("B", 0, 0),
        ("B", 1, 0),
        ("step",),
    ]
    assert schedules.backward_step_multimodule is fake_multimodule


def test_this_megatron_core_has_every_hooked_name() -> None:
    """The installed release passes the feature detection (0.17+ also has the MIMO backward)."""
    integration._check_api(schedules)
    version = tuple(int(x) for x in megatron_core.__version__.split(".")[:2])
    assert hasattr(schedules, "backward_step_multimodule") == (version >= (0, 17))


# -- Megatron-LM's own loop: patch_training ---------------------------------------------------


def _args(**changes: Any) -> types.SimpleNamespace:
    base = {
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": None,
        "cuda_graph_impl": "none",
        "cuda_graph_scope": [],
        "rampup_batch_size": None,
    }
    return types.SimpleNamespace(**(base | changes))


def test_the_workload_is_read_from_megatron_arguments() -> None:
    assert integration.workload_from_args(_args(), 8, 2) == {
        "num_stages": 4,
        "num_microbatches": 8,
        "stage": 2,
        "schedule": "1f1b",
        "num_chunks": 1,
    }
    interleaved = integration.workload_from_args(
        _args(virtual_pipeline_model_parallel_size=2), 8, 0
    )
    assert (interleaved["schedule"], interleaved["num_chunks"]) == ("interleaved", 2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cuda_graph_impl": "full_iteration"}, "full_iteration"),
        ({"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}, "full_iteration"),
        ({"rampup_batch_size": ["16", "16", "1000"]}, "rampup-batch-size"),
    ],
)
def test_megatron_settings_the_hooks_cannot_follow_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(NotSupportedError, match=message):
        integration.workload_from_args(_args(**changes), 8, 0)


def test_patch_training_refuses_workload_keywords_before_touching_megatron() -> None:
    with pytest.raises(InvalidArgumentError, match="num_microbatches, stage"):
        patch_training(stage=0, num_microbatches=4)
    assert patch_training(enabled=False) is None


@pytest.mark.skipif(megatron_training is not None, reason="this megatron-core ships training")
def test_patch_training_without_megatron_training_says_to_use_attach() -> None:
    with pytest.raises(NotSupportedError, match="from 0.17 on.*use attach"):
        patch_training()


@needs_training
def test_patch_training_wraps_the_train_that_pretrain_calls() -> None:
    original = megatron_training.train
    # pretrain() calls train() by its module-global name: the name patch_training replaces
    assert "train" in megatron_training.pretrain.__code__.co_names
    assert megatron_training.pretrain.__globals__ is vars(megatron_training)
    with patch_training(out_dir=None) as patch:
        assert patch.active and megatron_training.train is not original
        assert megatron_training.train.__powerlib_original__ is original
        with pytest.raises(NotSupportedError, match="already patched"):
            patch_training()
    assert megatron_training.train is original and not patch.active
    patch.restore()  # idempotent
    assert megatron_training.train is original


def test_env_options() -> None:
    assert integration.options_from_env({}) is None
    assert integration.options_from_env({"POWERLIB_MEGATRON": "0"}) is None
    assert integration.options_from_env({"POWERLIB_MEGATRON": "1"}) == {}
    on = {"POWERLIB_MEGATRON": "1", "POWERLIB_MEGATRON_OPTIONS": '{"out_dir": "/x"}'}
    assert integration.options_from_env(on) == {"out_dir": "/x"}
    for bad, message in (
        ({"POWERLIB_MEGATRON": "yes"}, "must be 1 or 0"),
        ({**on, "POWERLIB_MEGATRON_OPTIONS": "{out_dir"}, "is not JSON"),
        ({**on, "POWERLIB_MEGATRON_OPTIONS": "[1]"}, "JSON object"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            integration.options_from_env(bad)


def _launch_script(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m powerlib.integrations.megatron script.py a b``: the script reports its view."""
    script = tmp_path / "pretrain_like.py"
    script.write_text(
        "import json, sys\n"
        "try:\n"
        "    from megatron.training import training\n"
        "    patched = hasattr(training.train, '__powerlib_original__')\n"
        "except ImportError:\n"
        "    patched = None\n"
        "print(json.dumps({'argv': sys.argv, 'name': __name__, 'patched': patched}))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_MEGATRON")}
    return subprocess.run(
        [sys.executable, "-m", "powerlib.integrations.megatron", str(script), "a", "--b"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_launcher_runs_the_script_untouched_when_off(tmp_path: Path) -> None:
    done = _launch_script(tmp_path, {"POWERLIB_MEGATRON": "0"})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["argv"][1:] == ["a", "--b"] and seen["name"] == "__main__"
    assert seen["patched"] in (False, None)


@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_launcher_imports_the_script_siblings_from_another_folder(
    tmp_path: Path, switch: str
) -> None:
    """``pretrain_gpt.py`` imports ``gpt_builders`` from its own folder: launched from any other
    working directory, the script's folder is first on ``sys.path``, as ``python script.py``
    has it."""
    checkout, elsewhere = tmp_path / "Megatron-LM", tmp_path / "runs"
    checkout.mkdir()
    elsewhere.mkdir()
    (checkout / "gpt_builders.py").write_text("BUILDER = 'gpt'\n")
    (checkout / "pretrain_gpt.py").write_text(
        "import json, os, sys\n"
        "from gpt_builders import BUILDER\n"
        "print(json.dumps({'builder': BUILDER, 'path0': sys.path[0], 'cwd': os.getcwd()}))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("POWERLIB_MEGATRON")}
    done = subprocess.run(
        [sys.executable, "-m", "powerlib.integrations.megatron", "../Megatron-LM/pretrain_gpt.py"],
        cwd=elsewhere,
        env=clean | {"POWERLIB_MEGATRON": switch},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if switch == "1" and megatron_training is None:  # 0.16: refused before the script runs
        assert done.returncode == 2, done.stderr
        return
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"builder": "gpt", "path0": str(checkout), "cwd": str(elsewhere)}


@pytest.mark.parametrize("namespace", [False, True], ids=["package", "namespace"])
def test_the_launcher_imports_the_checkouts_megatron_not_the_installed_one(
    tmp_path: Path, namespace: bool
) -> None:
    """A Megatron-LM checkout run from elsewhere, off PYTHONPATH: ``POWERLIB_MEGATRON=1`` patches
    the checkout's ``megatron.training`` (beside the script), not an installed wheel's. Before
    issue 47 the launcher imported it before putting the script's folder on ``sys.path``: the
    wheel's loaded under the checkout's script (0.19: its dataset-helper build failed, the job
    died; 0.16: no megatron.training, refused). Megatron-LM's own checkout has no
    ``megatron/__init__.py`` (a namespace package, merged with the wheel's ``megatron.core``):
    both layouts."""
    checkout, elsewhere = tmp_path / "Megatron-LM", tmp_path / "runs"
    (checkout / "megatron" / "training").mkdir(parents=True)
    elsewhere.mkdir()
    if not namespace:
        (checkout / "megatron" / "__init__.py").write_text("")
    (checkout / "megatron" / "training" / "__init__.py").write_text("")
    (checkout / "megatron" / "training" / "training.py").write_text(
        "def train(*args, **kwargs):\n    return None\n"
    )
    (checkout / "pretrain_gpt.py").write_text(
        "import json\n"
        "from megatron.training import training\n"
        "print(json.dumps({'file': training.__file__,\n"
        "                  'patched': hasattr(training.train, '__powerlib_original__')}))\n"
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("POWERLIB_MEGATRON") and k != "PYTHONPATH"
    }
    done = subprocess.run(
        [sys.executable, "-m", "powerlib.integrations.megatron", "../Megatron-LM/pretrain_gpt.py"],
        cwd=elsewhere,
        env=clean | {"POWERLIB_MEGATRON": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "file": str(checkout / "megatron" / "training" / "training.py"),
        "patched": True,
    }


def test_the_launcher_patches_train_when_on(tmp_path: Path) -> None:
    done = _launch_script(tmp_path, {"POWERLIB_MEGATRON": "1"})
    if megatron_training is None:  # 0.16: one clear line, nothing run
        assert done.returncode == 2
        last = done.stderr.strip().splitlines()[-1]  # torch may log a line of its own first
        assert last.startswith("error: Megatron-LM's training loop cannot be imported"), last
        assert done.stdout == ""
        return
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["patched"] is True


def test_the_launcher_rejects_bad_options_in_one_line(tmp_path: Path) -> None:
    done = _launch_script(
        tmp_path, {"POWERLIB_MEGATRON": "1", "POWERLIB_MEGATRON_OPTIONS": '{"stage": 1}'}
    )
    if megatron_training is None:
        pytest.skip("0.16: the launcher stops at the missing megatron.training first")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == (
        "error: patch_training reads stage from Megatron's arguments: do not pass them"
    )


# -- end to end: a megatron-core GPT on a 2-stage pipeline ------------------------------------


@pytest.mark.parametrize(
    "mode", [pytest.param("pretrain", marks=needs_training), pytest.param("core")]
)
def test_gpt_pipeline_is_profiled_planned_and_applied(mode: str, tmp_path: Path) -> None:
    """Megatron-LM's own train() (patched) or megatron-core's schedule (attach) drives a GPT."""
    launch_ranks(GPT_WORKER, [str(tmp_path), mode], WORLD, tmp_path / "state")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, res in enumerate(results):
        assert res["warnings"] == [], res["warnings"]  # no refused plan, no order mismatch
        assert res["phase"] == "closed", res
        if mode == "core":  # the loop ran until the plan applied, then two more iterations
            assert_profiled_then_applied(res)
        else:  # Megatron's train() runs --train-iters: the sweep's most, then two
            first = res["applied_from"]
            assert SWEEP["warmup_iterations"] + len(FREQS) <= first <= MAX_PROFILE_ITERATIONS
            assert res["iterations"] == MAX_PROFILE_ITERATIONS + APPLIED_ITERATIONS
            assert res["profiled_freqs_mhz"] == FREQS
        assert res["spec"] == {"num_stages": WORLD, "num_microbatches": M, "stage": rank}
        assert res["order_source"] == "recorded"
        # the order the hooks recorded is megatron's 1F1B, and the plan has one clock each
        generated = build_schedule("1f1b", WORLD, M, 1)[rank]
        assert [(k, mb, c) for k, mb, c, _ in res["plan"]] == [
            (i.kind, i.microbatch, i.chunk) for i in generated
        ]
        assert all(isinstance(f, float) and f > 0 for *_, f in res["plan"])
        assert res["requested"] == res["plan"]  # the first applied iteration asked for each
        assert res["restored"]
        if mode == "pretrain":
            # train() ran its iterations and two evaluate() passes; only the former are steps
            assert res["train_iterations"] == res["megatron_args"]["train_iters"]
            assert res["iterations"] == res["train_iterations"]
            assert res["sessions"] == 1 and res["patched"] and res["unpatched"]
