"""The runtime: a session around the training loop (profile -> plan -> apply -> restore)."""

from powerlib.runtime.apply_phase import ApplyConfig, ApplyPhase
from powerlib.runtime.controller import AppliedChange, FrequencyController
from powerlib.runtime.coordination import LocalGroup, SingleProcess, TorchDistributed
from powerlib.runtime.listeners import InstructionListener
from powerlib.runtime.options import MODES, RunConfig
from powerlib.runtime.planning_step import PlanSpec, make_plan
from powerlib.runtime.profile_phase import ProfileConfig, ProfilePhase
from powerlib.runtime.session import Session, optimize

__all__ = [
    "MODES",
    "AppliedChange",
    "ApplyConfig",
    "ApplyPhase",
    "FrequencyController",
    "InstructionListener",
    "LocalGroup",
    "PlanSpec",
    "ProfileConfig",
    "ProfilePhase",
    "RunConfig",
    "Session",
    "SingleProcess",
    "TorchDistributed",
    "make_plan",
    "optimize",
]
