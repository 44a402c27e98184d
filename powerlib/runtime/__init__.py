"""The runtime: a session around the training loop (profile -> plan -> apply -> restore).

``powerlib.optimize(**keywords)`` (:func:`~powerlib.runtime.session.optimize`) makes a
:class:`~powerlib.runtime.session.Session` from flat keywords; ``Session(config)`` takes one
:class:`~powerlib.runtime.session_config.SessionConfig`.
"""

from powerlib.runtime.apply_phase import ApplyPhase
from powerlib.runtime.controller import AppliedChange, FrequencyController
from powerlib.runtime.coordination import LocalGroup, SingleProcess, TorchDistributed
from powerlib.runtime.listeners import InstructionListener
from powerlib.runtime.phases import RankFailure, SessionPhase
from powerlib.runtime.planning_step import make_plan
from powerlib.runtime.profile_phase import ProfilePhase
from powerlib.runtime.records import SessionReport, SessionStatus
from powerlib.runtime.session import Session, active_sessions, optimize
from powerlib.runtime.session_config import (
    ApplyConfig,
    Mode,
    PolicyConfig,
    RunConfig,
    SessionConfig,
    WorkloadConfig,
)
from powerlib.runtime.sweep import SweepConfig

__all__ = [
    "AppliedChange",
    "ApplyConfig",
    "ApplyPhase",
    "FrequencyController",
    "InstructionListener",
    "LocalGroup",
    "Mode",
    "PolicyConfig",
    "ProfilePhase",
    "RankFailure",
    "RunConfig",
    "Session",
    "SessionConfig",
    "SessionPhase",
    "SessionReport",
    "SessionStatus",
    "SingleProcess",
    "SweepConfig",
    "TorchDistributed",
    "WorkloadConfig",
    "active_sessions",
    "make_plan",
    "optimize",
]
