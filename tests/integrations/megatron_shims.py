"""Test-only shims that let megatron-core's (0.16.1-0.19.2) pipeline schedules run on CPU (gloo).

Megatron-core assumes CUDA in a few places of the schedule path. These shims patch ``torch.cuda``
**globally inside the process**, so they belong in test workers and CPU-only examples, never in
library code (docs/frameworks.md §5, "Megatron CPU shims"; §6.3 item 9). The reference's list, and
what this module does for each item:

1. ``torch.cuda.current_device`` -> ``torch.device("cpu")``: ``P2PCommunicator._communicate``
   allocates its receive buffers (and shape tensors) on the current device. Done by
   :func:`install`.
2. ``torch.cuda.synchronize`` -> no-op: called after the batched P2P exchange
   (``batch_p2p_comm=True, batch_p2p_sync=True``, the defaults). Done by :func:`install`;
   alternatively build the config with ``batch_p2p_sync=False``.
3. A ``TorchFunctionMode`` that rewrites any ``device="cuda…"`` keyword to ``"cpu"``, entered
   around the ``forward_backward_func`` call: all three schedules allocate
   ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`` (trial M0 fails there
   with "Torch not compiled with CUDA enabled"). Done by :func:`cuda_to_cpu`.
4. Only for real models that use the tensor-parallel RNG tracker (``GPTModel``): route
   ``torch.cuda.manual_seed``/``get_rng_state`` and ``tensor_parallel.random``'s
   ``_get_cuda_rng_state``/``_set_cuda_rng_state`` to the CPU RNG, and call
   ``model_parallel_cuda_manual_seed`` inside :func:`cuda_to_cpu`. The schedule tests use a
   custom stage module (below), which never touches the RNG tracker; :func:`checkpoint_rng`
   (activation recompute) and :func:`pretrain_on_cpu` route it.
5. Megatron-LM's whole ``pretrain()`` (its start-up asserts CUDA, moves models and batches to
   the device, opens streams): :func:`pretrain_on_cpu`, which includes 1-4.

A custom stage module must carry what the schedules look up: ``.config`` (the
``ModelParallelConfig``), ``.model_type`` (``ModelType.encoder_or_decoder``) and
``set_input_tensor()`` (trial M0's second failure: ``_get_attr_wrapped_model couldn't find
attribute model_type``). :class:`StageModule` is such a module around any ``torch.nn.Module``.

``torch.cuda.is_available()`` is left alone (except inside :func:`pretrain_on_cpu`, where
``torch.cuda.is_initialized()`` still is False), so powerlib's session still sees a CPU-only
process and does not pick ``torch.cuda.synchronize`` as its device sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "CudaToCpu",
    "StageModule",
    "cuda_to_cpu",
    "checkpoint_rng",
    "install",
    "pretrain_on_cpu",
    "sequence_parallel_norms",
]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpu(TorchFunctionMode):
    """Shim 3: every torch call with a ``device="cuda…"`` keyword gets ``device="cpu"``."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _TensorsStayOnCpu(CudaToCpu):
    """Shim 3, and ``Tensor.cuda()``, ``Tensor.to("cuda…")`` and ``Tensor.pin_memory()`` (the
    data loader's) keep a tensor where it is, on the CPU; ``Tensor.type()`` names the type the
    tensor would have on the GPU (gradient clipping asserts ``torch.cuda.FloatTensor``)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def cuda_to_cpu() -> CudaToCpu:
    """Shim 3 as a context manager: ``with cuda_to_cpu(): forward_backward_func(...)``."""
    return CudaToCpu()


def install() -> Callable[[], None]:
    """Shims 1 and 2; returns a function that puts the originals back."""
    saved = (torch.cuda.current_device, torch.cuda.synchronize)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    def uninstall() -> None:
        torch.cuda.current_device, torch.cuda.synchronize = saved

    return uninstall


class StageModule(torch.nn.Module):
    """A pipeline stage (or model chunk) Megatron's schedules accept: wraps ``body``.

    The schedule hands the received activation to :meth:`set_input_tensor` before each forward;
    the first stage has none and takes its input from the data iterator instead.
    """

    def __init__(self, body: torch.nn.Module, config: Any) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.body = body
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron passes a list with one tensor (``None`` on the first stage)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` from the data on the first stage, else the received activation."""
        return self.body(self.input_tensor if self.input_tensor is not None else x)


def sequence_parallel_norms() -> Callable[[], None]:
    """Torch norms under sequence parallelism (docs/frameworks.md §5; the reference's patch 4).

    megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel`` (its fused norms handle
    it on GPU). The norm itself is the same on a sequence shard; what SP adds is that its
    parameters' gradients are partial per shard: the norm is built with SP off and its
    parameters tagged ``sequence_parallel = True``, the tag ``finalize_model_grads`` all-reduces
    by. Returns a function that puts the original back.
    """
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def build(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = build  # type: ignore[method-assign]

    def uninstall() -> None:
        torch_norm.WrappedTorchNorm.__new__ = original  # type: ignore[method-assign]

    return uninstall


def checkpoint_rng() -> Callable[[], None]:
    """Activation recompute on CPU: the checkpoint's "CUDA" RNG state is a CPU one.

    ``tensor_parallel.checkpoint`` saves and restores the CUDA RNG state around the recomputed
    forward (``_get_cuda_rng_state``/``_set_cuda_rng_state``), which fails with "Torch not
    compiled with CUDA enabled". The CPU generator, which it saves too, is the only one a CPU
    run draws from: the CUDA state is stood in for by a copy of it, and setting it does nothing.
    Returns a function that puts the originals back.
    """
    from megatron.core.tensor_parallel import random

    saved = (random._get_cuda_rng_state, random._set_cuda_rng_state)
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda *args, **kwargs: None

    def uninstall() -> None:
        random._get_cuda_rng_state, random._set_cuda_rng_state = saved

    return uninstall


class _HostStream:
    """A CUDA stream on the CPU: work is done when it is issued, so there is nothing to wait."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False


@contextlib.contextmanager
def pretrain_on_cpu() -> Iterator[None]:
    """Megatron-LM's real ``pretrain()`` on CPU: shims 1-4 and what its start-up asks of CUDA.

    Inside the block: ``torch.cuda.is_available()`` is True and ``device_count()`` 1
    (``initialize_megatron`` asserts the first, and sets up model parallelism and its seeds only
    with a device; ``torch.cuda.is_initialized()`` stays False, so powerlib's session still
    stamps and syncs on the host); ``set_device`` does nothing; CUDA streams (DDP's
    initialisation stream, torch's optimizer asking the accelerator's stream whether a graph is
    being captured) are host streams that never capture; ``Module.cuda()``, ``Tensor.cuda()``,
    ``Tensor.to("cuda")`` and ``Tensor.pin_memory()`` leave models and batches on the CPU, and
    ``Tensor.type()`` names the CUDA type (gradient clipping asserts it); the "CUDA" RNG states
    the seed tracker keeps and forks are the CPU generator's (shim 4, :func:`checkpoint_rng`),
    so dropout must be 0. Not CUDA, but the wheel: ``initialize_megatron`` runs ``make`` in
    ``megatron/core/datasets`` to build the dataset index helpers, which megatron-core wheels
    ship built (``helpers_cpp``) without the Makefile of a source checkout: the build is
    skipped. Everything is put back on exit.
    """
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (prebuilt, or fail here)
    from megatron.core.datasets import utils as dataset_utils

    compile_helpers = dataset_utils.compile_helpers
    dataset_utils.compile_helpers = lambda: None
    cuda = torch.cuda
    names = ("is_available", "device_count", "set_device", "get_rng_state")
    names += ("is_current_stream_capturing", "Stream", "current_stream", "stream")
    saved = {name: getattr(cuda, name) for name in names}
    saved_module_cuda = torch.nn.Module.cuda
    saved_accelerator_stream = torch.accelerator.current_stream
    uninstall, uninstall_rng = install(), checkpoint_rng()
    cuda.is_available = lambda: True  # type: ignore[assignment]
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    cuda.set_device = lambda device: None  # type: ignore[assignment]
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    cuda.is_current_stream_capturing = lambda: False  # type: ignore[assignment]
    cuda.Stream = _HostStream  # type: ignore[assignment, misc]
    cuda.current_stream = lambda device=None: _HostStream()  # type: ignore[assignment]
    cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    # torch's optimizers ask the accelerator's stream whether a CUDA graph is being captured
    torch.accelerator.current_stream = cuda.current_stream  # type: ignore[assignment]
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign]
    try:
        with _TensorsStayOnCpu():
            yield
    finally:
        for name, value in saved.items():
            setattr(cuda, name, value)
        torch.nn.Module.cuda = saved_module_cuda  # type: ignore[method-assign]
        torch.accelerator.current_stream = saved_accelerator_stream  # type: ignore[assignment]
        dataset_utils.compile_helpers = compile_helpers
        uninstall_rng()
        uninstall()
