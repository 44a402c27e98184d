"""The runtime: a session around the training loop (profile -> plan -> apply -> restore)."""

from powerlib.runtime.controller import AppliedChange, FrequencyController
from powerlib.runtime.coordination import LocalGroup, SingleProcess, TorchDistributed
from powerlib.runtime.launch_control import LaunchRecord, Overlap, OverlapSchedule, SMGroups
from powerlib.runtime.planning_step import PlanSpec, make_plan
from powerlib.runtime.session import MODES, Session, optimize

__all__ = [
    "MODES",
    "AppliedChange",
    "FrequencyController",
    "LaunchRecord",
    "LocalGroup",
    "Overlap",
    "OverlapSchedule",
    "PlanSpec",
    "SMGroups",
    "Session",
    "SingleProcess",
    "TorchDistributed",
    "make_plan",
    "optimize",
]
