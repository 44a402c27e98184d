"""The device the run opens, and the work it runs there.

On a real GPU: a bf16 matmul load and a stack of transformer layers (:class:`TorchWork`, CUDA
torch). In ``--smoke``: the simulated GPU's work API (:class:`SimWork`), and the device of the
simulated backend. :func:`open_rig` opens one or the other, or says in one line why it cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import powerlib
from powerlib import Device, PowerlibError

from .harness import (
    REAL,
    RESULTS,
    SMOKE,
    Report,
    Rig,
    Work,
    gpu_slug,
    pick_clocks,
    rounded,
)

FORWARD_S = 0.0225  # D: the forward's target length on the GPU (the backward is about twice)


class _OnOff:
    """The on/off load of part A, for any work source with ``busy(seconds)``."""

    def busy(self, seconds: float) -> float:  # pragma: no cover - each work source has its own
        raise NotImplementedError

    def onoff(self, total_s: float, on_s: float, off_s: float) -> float:
        """Alternate ``on_s`` of load and ``off_s`` idle for ``total_s``; the busy seconds."""
        busy = 0.0
        end = time.perf_counter() + total_s
        while time.perf_counter() < end:
            busy += self.busy(on_s)
            time.sleep(off_s)
        return busy


class SimWork(_OnOff):
    """``--smoke``: the simulated GPU's work API (``begin_work``/``end_work``) stands in for kernels.

    A unit's duration at the clock in force is slept on the wall clock, so the session, the
    sampler and the controller see the same timing as they would around a synchronized kernel.
    """

    def __init__(self, dev: Any) -> None:
        from powerlib.backends.simulated_model import WorkUnit

        self.dev = dev
        self.units = {
            "forward": WorkUnit(
                time_at_max_s=0.006, compute_fraction=0.85, sm_activity=0.8, memory_activity=0.3
            ),
            "backward": WorkUnit(
                time_at_max_s=0.012, compute_fraction=0.85, sm_activity=0.95, memory_activity=0.3
            ),
        }
        self.matmul = WorkUnit(time_at_max_s=3600.0, sm_activity=1.0, memory_activity=0.5)

    def describe(self) -> dict[str, Any]:
        """What stands in for the GPU's work."""
        return {
            "kind": "simulated work units (backends/simulated_model.py WorkUnit), slept on the wall clock",
            **{k: dataclasses.asdict(u) for k, u in self.units.items()},
            "matmul_load": dataclasses.asdict(self.matmul),
        }

    def sync(self) -> None:
        """Nothing is queued: every unit is slept through."""

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        """A steady full load (the matmul's stand-in) while the block runs."""
        self.dev.begin_work(self.matmul)
        try:
            yield
        finally:
            self.dev.end_work()

    def busy(self, seconds: float) -> float:
        """Load for ``seconds``; returns how long it ran."""
        self.dev.begin_work(self.matmul)
        t0 = time.perf_counter()
        try:
            time.sleep(seconds)
        finally:
            elapsed_s = time.perf_counter() - t0
            self.dev.end_work()
        return elapsed_s

    def run(self, kind: str, microbatch: int) -> None:
        """One instruction, to its end."""
        duration_s = self.dev.begin_work(self.units[kind])
        try:
            time.sleep(duration_s)
        finally:
            self.dev.end_work()

    def prepare(self, kind: str) -> Callable[[], None]:
        """One instruction of ``kind`` as a repeatable call (D's reference)."""
        return lambda: self.run(kind, 0)

    def end_iteration(self) -> None:
        """Nothing to free."""


class TorchWork(_OnOff):
    """The GPU's work on a real device: a bf16 matmul load and a transformer-layer stack.

    The stack is ``torch.nn.TransformerEncoderLayer`` (pre-norm, no dropout, bf16) repeated as many
    times as it takes a forward to last about ``forward_s`` (measured: one layer is timed first);
    a backward takes about twice as long. A forward keeps its graph until its backward, as in a
    pipeline stage. On the CPU (``--smoke``) the same code runs once at tiny sizes.
    """

    def __init__(self, torch: Any, device: Any, *, tiny: bool = False) -> None:
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        dtype = torch.bfloat16 if self.cuda else torch.float32
        if tiny:
            d_model, nhead, ff, batch, seq, n = 64, 4, 128, 2, 16, 64
        else:
            d_model, nhead, ff, batch, seq, n = 4096, 32, 16384, 4, 2048, 8192
        self.shape = {
            "d_model": d_model,
            "nhead": nhead,
            "dim_feedforward": ff,
            "batch": batch,
            "seq": seq,
            "dtype": str(dtype).replace("torch.", ""),
        }

        def layer() -> Any:
            return torch.nn.TransformerEncoderLayer(
                d_model,
                nhead,
                ff,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
                device=device,
                dtype=dtype,
            )

        self._layer: Callable[[], Any] = layer
        self.x = torch.randn(batch, seq, d_model, device=device, dtype=dtype)
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.c = torch.empty_like(self.a)
        self.matmul_s = self._time(lambda: torch.mm(self.a, self.a, out=self.c), 5)
        self.model = torch.nn.Sequential(self._layer())
        one_layer_s = self._time(lambda: self.model(self.x), 3)
        self.layers = 1 if tiny else max(1, min(48, round(FORWARD_S / one_layer_s)))
        if self.layers > 1:
            self.model = torch.nn.Sequential(*(self._layer() for _ in range(self.layers)))
        self.pending: dict[int, Any] = {}
        self.forward_s = self._time(lambda: self.model(self.x), 3)
        self.backward_s = self._time(self.prepare("backward"), 3)
        self.end_iteration()

    def describe(self) -> dict[str, Any]:
        """Sizes and the times measured at the default clocks."""
        return {
            "kind": f"torch.nn.TransformerEncoderLayer x {self.layers} on {self.device}",
            **self.shape,
            "layers": self.layers,
            "forward_s_default_clocks": rounded(self.forward_s),
            "backward_s_default_clocks": rounded(self.backward_s),
            "matmul_load": f"torch.mm {tuple(self.a.shape)} {self.shape['dtype']}",
            "matmul_s": rounded(self.matmul_s),
        }

    def _time(self, fn: Callable[[], object], n: int) -> float:
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / n

    def sync(self) -> None:
        """Wait for the queued kernels."""
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        """A steady matmul load on a thread while the block runs."""
        stop = threading.Event()

        def spin() -> None:
            if self.cuda:
                self.torch.cuda.set_device(self.device)
            while not stop.is_set():
                for _ in range(4):
                    self.torch.mm(self.a, self.a, out=self.c)
                self.sync()

        thread = threading.Thread(target=spin, name="matmul-load", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def busy(self, seconds: float) -> float:
        """Matmuls for about ``seconds``; returns how long they ran."""
        t0 = time.perf_counter()
        for _ in range(max(1, round(seconds / self.matmul_s))):
            self.torch.mm(self.a, self.a, out=self.c)
        self.sync()
        return time.perf_counter() - t0

    def run(self, kind: str, microbatch: int) -> None:
        """Launch one instruction (a forward keeps its graph for the backward)."""
        if kind == "forward":
            self.pending[microbatch] = self.model(self.x).float().square().mean()
        else:
            self.pending.pop(microbatch).backward()

    def prepare(self, kind: str) -> Callable[[], None]:
        """One instruction of ``kind`` as a repeatable call (a backward repeats one graph)."""
        if kind == "forward":
            return lambda: self.model(self.x)
        loss = self.model(self.x).float().square().mean()
        return lambda: loss.backward(retain_graph=True)

    def end_iteration(self) -> None:
        """Drop the graphs and the gradients."""
        self.pending.clear()
        self.model.zero_grad(set_to_none=True)


# -- opening the device ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Opened:
    backend: Any
    dev: Device
    work: Work
    torch: Any = None
    nvml: tuple[Any, Any] | None = None


def _open_smoke() -> _Opened:
    backend = powerlib.open_backend()
    dev = backend.devices()[0]
    return _Opened(backend, dev, SimWork(dev))


def _open_gpu(index: int) -> _Opened | str:
    """The GPU at CUDA ``index`` through its backend, and CUDA torch's work on it."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: the run needs CUDA torch (or use --smoke)"
    if not torch.cuda.is_available():
        return "CUDA is not available to torch: run on the GPU node (or use --smoke)"
    backend = powerlib.open_backend()
    if backend.name == "simulated":
        backend.close()
        return "POWERLIB_BACKEND=simulated without --smoke: the run needs the GPU's backend"
    torch.cuda.set_device(index)
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "")).lower()
    dev = next(
        (d for d in backend.devices() if uuid and d.device_id.lower() in (uuid, f"gpu-{uuid}")),
        None,
    ) or backend.device(index)  # a torch without uuid: the same index
    work = TorchWork(torch, torch.device("cuda", index))
    nvml = _nvml_handle(dev.device_id) if backend.name == "nvidia" else None
    return _Opened(backend, dev, work, torch, nvml)


def open_rig(
    args: argparse.Namespace, report_path: Path | None, tmp: Path, started: float
) -> Rig | str:
    """The backend, the device and its work; a one-line reason when they cannot be had."""
    smoke = args.smoke
    try:
        opened = _open_smoke() if smoke else _open_gpu(args.device)
    except (PowerlibError, IndexError) as err:
        return f"no device to run on: {err or 'the backend lists none'}"
    if isinstance(opened, str):
        return opened
    path = report_path or (
        Path(tempfile.gettempdir()) / "gpu_acceptance_smoke.json"
        if smoke
        else RESULTS / f"gpu_acceptance_{gpu_slug(opened.dev.info.name)}.json"
    )
    scale = SMOKE if smoke else REAL
    rig = Rig(
        args=args,
        scale=scale,
        smoke=smoke,
        backend=opened.backend,
        dev=opened.dev,
        work=opened.work,
        report=Report(path, smoke),
        tmp=tmp,
        nvml=opened.nvml,
        torch=opened.torch,
    )
    rig.deadline = started + (args.budget_s or scale.budget_s)
    rig.freqs = pick_clocks(opened.dev.info.supported_sm_freqs_mhz, scale.clocks)
    return rig


def _nvml_handle(device_id: str) -> tuple[Any, Any] | None:
    """pynvml and the handle of the GPU with this UUID (A's field-timestamp reads)."""
    try:
        from powerlib.backends._nvml_api import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if (uuid.decode() if isinstance(uuid, bytes) else uuid) == device_id:
                return nvml, handle
    except Exception:  # A then says "not available"
        return None
    return None
