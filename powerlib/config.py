"""Settings, read from the environment in one place.

This is the only module that reads ``os.environ``, apart from the systemd socket protocol
(``LISTEN_FDS``, ``NOTIFY_SOCKET``) that powerlib/agent/listener.py speaks. Everything else
receives a frozen :class:`Settings`, so tests build one directly instead of patching the
environment, and a library user can pass one explicitly.

Environment variables:

========================  =================================================================
``POWERLIB_BACKEND``      ``auto`` (default), ``nvidia``, ``amd``, ``sysfs``, ``simulated``, or
                          the name of a plug-in registered under the ``powerlib.backends``
                          entry-point group. ``auto`` probes nvidia → amd → sysfs and never
                          picks ``simulated``.
``POWERLIB_SYSFS_ROOT``   Where sysfs is mounted (default ``/sys``). Point it at a bind mount
                          (containers mask powercap) or a fake tree (tests).
``POWERLIB_STATE_DIR``    Locks, journals and simulated-device state. Default: ``/run/powerlib``
                          when writable (root); else ``/run/powerlib/users/<uid>`` when a Slurm
                          prolog made it for this user (``powerlib agent grant``); else
                          ``$XDG_RUNTIME_DIR/powerlib`` (when it is the user's own); else
                          ``$TMPDIR/powerlib-<uid>``. Must be a local file system, owned by
                          the user (or root) and writable by nobody else.
``POWERLIB_SIM_GPUS``     Number of simulated GPUs (default 4).
``POWERLIB_SIM_MODEL``    Simulated GPU model: ``a100`` (default), ``h100``, ``a40``.
``POWERLIB_SIM_CLOCK``    ``wall`` (default; state persists across processes) or ``virtual``
                          (time advances only when simulated work runs; nothing persists).
``POWERLIB_SIM_*``        The simulated GPU's NVML-like behaviour (docs/backends.md, "The
                          simulated GPU"): ``ENERGY_PERIOD_S`` (counter period, default the
                          model's 0.1 s), ``SWITCH_LATENCY_S`` and ``LATENCY_SPREAD``
                          (clock-change landing, default the model's 0.02 s ± 50 %),
                          ``READ_COST_S`` (what a ``read_state`` takes, default 0), ``NOISE``
                          (run-to-run noise on each work unit, default 0), ``SEED``
                          (default 0) and ``TIME_FOLLOWS_CLOCK`` (``1``: a session's
                          instructions last what the running clock makes them; default 1,
                          ``0``: the host's time whatever the clock).
``POWERLIB_AGENT_SOCKET`` The node agent's socket for ``POWERLIB_BACKEND=agent`` (default
                          ``/run/powerlib/agent/agent.sock``, in a folder of its own that pods
                          mount read-only; docs/agent.md).
========================  =================================================================

Also honoured, with their usual meaning: ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``
(NVIDIA), ``ROCR_VISIBLE_DEVICES`` and ``HIP_VISIBLE_DEVICES`` (AMD). Unset means "all devices";
set to the empty string means "no devices".

Read at each use, by the functions below rather than :class:`Settings` (a process may change
them while it runs, and a bad value falls back instead of failing):

- ``POWERLIB_MAX_INPUT_BYTES``: the cap on an untrusted file (:func:`max_input_bytes`);
- ``POWERLIB_MEASURE_EVENTS``: the events file ``powerlib measure -- CMD`` names for its child
  (:func:`measure_events_path`; docs/measurement.md §6);
- ``RANK``: the launcher's rank of this process, before ``torch.distributed`` starts
  (:func:`launcher_rank`);
- ``POWERLIB_DIRECT_SOLVER``: ``highs`` makes ``powerlib plan`` and a session's rank 0 solve
  their direct points with HiGHS even where the compiled flow is built (:func:`direct_solver`; benchmarks compare both);
- ``POWERLIB_DISABLE``: ``1`` (``true``, ``yes``, ``on``) runs every training session disabled,
  measuring only (:func:`sessions_disabled`; the A side of an A/B run);
- ``POWERLIB_MEGATRON`` and ``POWERLIB_MEGATRON_OPTIONS``: the Megatron launcher's switch and
  its session keywords as JSON (:func:`megatron_launch`; docs/megatron.md).
- ``POWERLIB_SCONTROL``, ``POWERLIB_SACCTMGR``: the ``scontrol`` and ``sacctmgr`` that
  ``powerlib job-energy end --sacct`` runs (:func:`scontrol_command`,
  :func:`sacctmgr_command`; default: found on ``PATH``).

A child process powerlib starts (the guardian, ``powerlib measure``'s command) inherits this
process's environment plus what :func:`child_environment` adds.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from powerlib.errors import ConfigError

__all__ = [
    "DEFAULT_AGENT_SOCKET",
    "MAX_INPUT_BYTES_ENV",
    "MAX_SIM_NOISE",
    "MEASURE_EVENTS_ENV",
    "NODE_STATE_DIR",
    "SIM_CLOCKS",
    "Settings",
    "child_environment",
    "default_state_dir",
    "direct_solver",
    "launcher_rank",
    "max_input_bytes",
    "measure_events_path",
    "megatron_launch",
    "sacctmgr_command",
    "scontrol_command",
    "sessions_disabled",
    "user_state_dirs",
]

SIM_CLOCKS = ("wall", "virtual")

MAX_SIM_NOISE = 0.25
"""Largest ``POWERLIB_SIM_NOISE``: the simulated noise is clipped to ±3 σ, so a factor stays > 0."""

# (variable, Settings field, lowest, highest): the simulated GPU's real-valued knobs.
_SIM_FLOAT_KNOBS = (
    ("POWERLIB_SIM_SWITCH_LATENCY_S", "sim_switch_latency_s", 0.0, 10.0),
    ("POWERLIB_SIM_LATENCY_SPREAD", "sim_latency_spread", 0.0, 1.0),
    ("POWERLIB_SIM_READ_COST_S", "sim_read_cost_s", 0.0, 1.0),
    ("POWERLIB_SIM_NOISE", "sim_noise", 0.0, MAX_SIM_NOISE),
)

NODE_STATE_DIR = Path("/run/powerlib")
"""Root's state folder on a node: its journals and device locks, the agent's job grants
(``grants/``), and the per-user state folders a prolog creates (``users/<uid>``)."""

DEFAULT_AGENT_SOCKET = NODE_STATE_DIR / "agent" / "agent.sock"
"""The agent's socket, alone in its folder: the one folder a pod mounts (read-only)."""


MEASURE_EVENTS_ENV = "POWERLIB_MEASURE_EVENTS"
"""Names the events file a measured command's own measurements append to (docs/measurement.md §6)."""


MAX_INPUT_BYTES_ENV = "POWERLIB_MAX_INPUT_BYTES"
"""Raises the cap on an untrusted input file (:func:`max_input_bytes`)."""


def max_input_bytes(environ: Mapping[str, str] | None = None) -> int | None:
    """``POWERLIB_MAX_INPUT_BYTES`` when set to a positive integer, else ``None`` (the default cap)."""
    env = os.environ if environ is None else environ
    raw = env.get(MAX_INPUT_BYTES_ENV, "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return None


def measure_events_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The events file ``POWERLIB_MEASURE_EVENTS`` names (``None``: unset or empty)."""
    env = os.environ if environ is None else environ
    raw = env.get(MEASURE_EVENTS_ENV) or None
    return Path(raw) if raw else None


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """The launcher's ``RANK`` of this process (torchrun, Slurm wrappers); 0 when unset or bad."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("RANK", "0"))
    except ValueError:
        return 0


def direct_solver(environ: Mapping[str, str] | None = None) -> str:
    """``highs`` when ``POWERLIB_DIRECT_SOLVER=highs`` forces HiGHS, else ``auto``."""
    env = os.environ if environ is None else environ
    return "highs" if env.get("POWERLIB_DIRECT_SOLVER", "") == "highs" else "auto"


def child_environment(
    extra: Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a child process starts with: ``base`` (default this process's) plus ``extra``."""
    return dict(os.environ if base is None else base) | dict(extra)


def sessions_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``POWERLIB_DISABLE`` set to 1/true/yes/on: every training session measures only."""
    env = os.environ if environ is None else environ
    return env.get("POWERLIB_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


def megatron_launch(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(POWERLIB_MEGATRON, POWERLIB_MEGATRON_OPTIONS)`` as set, stripped (``""`` when unset).

    The Megatron launcher (``python -m powerlib.integrations.megatron``) checks the values.
    """
    env = os.environ if environ is None else environ
    switch = env.get("POWERLIB_MEGATRON", "0").strip()
    return switch, env.get("POWERLIB_MEGATRON_OPTIONS", "").strip()


def scontrol_command(environ: Mapping[str, str] | None = None) -> str:
    """``POWERLIB_SCONTROL`` (the ``scontrol`` a job-energy epilog runs), else ``scontrol``."""
    env = os.environ if environ is None else environ
    return env.get("POWERLIB_SCONTROL", "").strip() or "scontrol"


def sacctmgr_command(environ: Mapping[str, str] | None = None) -> str:
    """``POWERLIB_SACCTMGR`` (the ``sacctmgr`` a job-energy epilog runs), else ``sacctmgr``."""
    env = os.environ if environ is None else environ
    return env.get("POWERLIB_SACCTMGR", "").strip() or "sacctmgr"


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The state directory used when ``POWERLIB_STATE_DIR`` is not set.

    ``/run/powerlib`` for root; else ``/run/powerlib/users/<uid>`` when a prolog created it for
    this user (the user's, 0700, in root's ``users/``: nobody can plant it, unlike a folder in
    ``/tmp``); else ``$XDG_RUNTIME_DIR/powerlib`` when that is a directory of
    this user that nobody else can write (``sudo`` may carry another user's); else
    ``$TMPDIR/powerlib-<uid>`` (normally ``/tmp/powerlib-<uid>``). ``/run`` is cleared at boot,
    exactly when device settings revert too, so a journal there never outlives the state it
    describes. The directory is created 0700 by the first session that needs it; one that
    another user created or can write is refused (see :mod:`powerlib.control.state`).
    """
    env = os.environ if environ is None else environ
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        return NODE_STATE_DIR
    prepared = NODE_STATE_DIR / "users" / str(os.geteuid())
    if _is_private_dir(str(prepared)) and _is_root_dir(prepared.parent):
        return prepared
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and _is_private_dir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "powerlib"
    return Path(tempfile.gettempdir()) / f"powerlib-{os.geteuid()}"


def user_state_dirs(uid: int, node_state_dir: Path = NODE_STATE_DIR) -> tuple[Path, ...]:
    """Where uid's sessions keep their state by default, for a restore acting for that user.

    The folder a prolog made (``<node>/users/<uid>``), the user's runtime folder
    (``/run/user/<uid>/powerlib``) and ``$TMPDIR/powerlib-<uid>``, in the order
    :func:`default_state_dir` prefers them.
    """
    return (
        node_state_dir / "users" / str(uid),
        Path("/run/user") / str(uid) / "powerlib",
        Path(tempfile.gettempdir()) / f"powerlib-{uid}",
    )


def _is_root_dir(path: Path) -> bool:
    """True for a real directory of root's that nobody else can write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def _is_private_dir(path: str) -> bool:
    """True for a real directory of this user that nobody else can write (a runtime dir)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Everything powerlib reads from the environment, parsed and validated.

    Attributes:
        backend: Backend name, or ``"auto"``.
        sysfs_root: Root under which every sysfs path is resolved.
        state_dir: Directory for locks, journals and simulated-device state.
        sim_gpus: Number of simulated GPUs.
        sim_model: Simulated GPU model key.
        sim_clock: ``"wall"`` or ``"virtual"``.
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` as set (``None`` when unset).
        cuda_device_order: ``CUDA_DEVICE_ORDER`` (``FASTEST_FIRST`` or ``PCI_BUS_ID``).
        hip_visible_devices: ``HIP_VISIBLE_DEVICES`` as set (``None`` when unset).
        rocr_visible_devices: ``ROCR_VISIBLE_DEVICES`` as set (``None`` when unset).
        local_rank: ``LOCAL_RANK`` (set by torchrun): the session's default device index.
        sim_energy_period_s: Update period of the simulated energy counter (``None``: the
            model's, 0.1 s like NVML).
        sim_switch_latency_s: Mean delay before a simulated clock change runs (``None``: the
            model's, 0.02 s).
        sim_latency_spread: A simulated clock change lands after
            ``latency * U(1 - spread, 1 + spread)`` (``None``: the model's, 0.5).
        sim_read_cost_s: What one simulated ``read_state`` takes (NVML's: 2.6-3.1 ms on an H200).
        sim_noise: Run-to-run multiplicative noise (standard deviation) on each simulated work
            unit's duration and energy.
        sim_seed: Seed of the simulated latency and noise draws.
        sim_time_follows_clock: A session's instructions on a wall-clock simulated GPU last
            what its running clock makes them (``POWERLIB_SIM_TIME_FOLLOWS_CLOCK``, default 1:
            a CPU job then shows the trade-off a GPU job has; 0: the host's time).
        agent_socket: The node agent's socket (``POWERLIB_AGENT_SOCKET``).
    """

    backend: str = "auto"
    sysfs_root: Path = Path("/sys")
    state_dir: Path = field(default_factory=default_state_dir)
    sim_gpus: int = 4
    sim_model: str = "a100"
    sim_clock: str = "wall"
    cuda_visible_devices: str | None = None
    cuda_device_order: str = "FASTEST_FIRST"
    hip_visible_devices: str | None = None
    rocr_visible_devices: str | None = None
    local_rank: int | None = None
    sim_energy_period_s: float | None = None
    sim_switch_latency_s: float | None = None
    sim_latency_spread: float | None = None
    sim_read_cost_s: float = 0.0
    sim_noise: float = 0.0
    sim_seed: int = 0
    sim_time_follows_clock: bool = True
    agent_socket: Path = DEFAULT_AGENT_SOCKET

    def __post_init__(self) -> None:
        if not self.backend or self.backend != self.backend.strip().lower():
            raise ConfigError(
                f"invalid backend name {self.backend!r}: use lower-case names such as "
                "auto, nvidia, amd, sysfs, simulated"
            )
        if self.sim_gpus < 0 or self.sim_gpus > 1024:
            raise ConfigError(f"POWERLIB_SIM_GPUS must be between 0 and 1024, got {self.sim_gpus}")
        if self.cuda_device_order not in ("FASTEST_FIRST", "PCI_BUS_ID"):
            raise ConfigError(
                "CUDA_DEVICE_ORDER must be FASTEST_FIRST or PCI_BUS_ID, "
                f"got {self.cuda_device_order!r}"
            )
        if self.sim_clock not in SIM_CLOCKS:
            raise ConfigError(
                f"POWERLIB_SIM_CLOCK must be one of {', '.join(SIM_CLOCKS)}, got {self.sim_clock!r}"
            )
        for var, key, lo, hi in _SIM_FLOAT_KNOBS:
            value = getattr(self, key)
            if value is not None and not lo <= value <= hi:  # False for NaN too
                raise ConfigError(f"{var} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        if not 0 <= self.sim_seed < 2**63:
            raise ConfigError(
                f"POWERLIB_SIM_SEED must be an integer in [0, 2**63), got {self.sim_seed}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from environment variables (``os.environ`` by default).

        Raises:
            ConfigError: A variable has an invalid value; the message names it and the valid ones.
        """
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}
        backend = env.get("POWERLIB_BACKEND", "").strip()
        if backend:
            kwargs["backend"] = backend.lower()
        if env.get("POWERLIB_SYSFS_ROOT"):
            kwargs["sysfs_root"] = Path(env["POWERLIB_SYSFS_ROOT"])
        kwargs["state_dir"] = (
            Path(env["POWERLIB_STATE_DIR"])
            if env.get("POWERLIB_STATE_DIR")
            else default_state_dir(env)
        )
        if env.get("POWERLIB_AGENT_SOCKET", "").strip():
            kwargs["agent_socket"] = Path(env["POWERLIB_AGENT_SOCKET"].strip())
        if env.get("POWERLIB_SIM_GPUS"):
            raw = env["POWERLIB_SIM_GPUS"]
            try:
                kwargs["sim_gpus"] = int(raw)
            except ValueError:
                raise ConfigError(f"POWERLIB_SIM_GPUS must be an integer, got {raw!r}") from None
        if env.get("POWERLIB_SIM_MODEL"):
            kwargs["sim_model"] = env["POWERLIB_SIM_MODEL"].strip().lower()
        if env.get("POWERLIB_SIM_CLOCK"):
            kwargs["sim_clock"] = env["POWERLIB_SIM_CLOCK"].strip().lower()
        for var, key in (
            ("CUDA_VISIBLE_DEVICES", "cuda_visible_devices"),
            ("HIP_VISIBLE_DEVICES", "hip_visible_devices"),
            ("ROCR_VISIBLE_DEVICES", "rocr_visible_devices"),
        ):
            if var in env:
                kwargs[key] = env[var]
        if env.get("POWERLIB_SIM_ENERGY_PERIOD_S", "").strip():
            raw = env["POWERLIB_SIM_ENERGY_PERIOD_S"].strip()
            try:
                period = float(raw)
            except ValueError:
                period = -1.0
            if not (period > 0 and period <= 10):
                raise ConfigError(
                    f"POWERLIB_SIM_ENERGY_PERIOD_S must be a number of seconds in (0, 10], got {raw!r}"
                )
            kwargs["sim_energy_period_s"] = period
        for var, key, lo, hi in _SIM_FLOAT_KNOBS:
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not lo <= value <= hi:
                raise ConfigError(f"{var} must be a number in [{lo:g}, {hi:g}], got {raw!r}")
            kwargs[key] = value
        if env.get("POWERLIB_SIM_SEED", "").strip():
            raw = env["POWERLIB_SIM_SEED"].strip()
            if not (raw.isascii() and raw.isdecimal() and len(raw) <= 19 and int(raw) < 2**63):
                raise ConfigError(
                    f"POWERLIB_SIM_SEED must be an integer in [0, 2**63), got {raw!r}"
                )
            kwargs["sim_seed"] = int(raw)
        raw = env.get("POWERLIB_SIM_TIME_FOLLOWS_CLOCK", "").strip()
        if raw:
            if raw not in ("0", "1"):
                raise ConfigError(f"POWERLIB_SIM_TIME_FOLLOWS_CLOCK must be 0 or 1, got {raw!r}")
            kwargs["sim_time_follows_clock"] = raw == "1"
        if env.get("LOCAL_RANK", "").strip():
            raw = env["LOCAL_RANK"].strip()
            if not raw.isdigit():
                raise ConfigError(f"LOCAL_RANK must be a non-negative integer, got {raw!r}")
            kwargs["local_rank"] = int(raw)
        if env.get("CUDA_DEVICE_ORDER"):
            kwargs["cuda_device_order"] = env["CUDA_DEVICE_ORDER"].strip().upper()
        return cls(**kwargs)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> Settings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
