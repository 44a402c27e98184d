"""Kareus: joint per-partition launch point, SM share and clock, composed into Perseus plans.

Optional: the core (session, planner, measurement) never imports this package; the launch control
registers itself with a session as an instruction listener (:mod:`powerlib.runtime.listeners`).
docs/kareus.md describes the method; the modules, by what they hold:

- **Partitions** (pure): ``shapes`` the reference models' layer shapes and the stage parallelism;
  ``partition_types`` the operation, partition and configuration types; ``partition`` a stage's
  partition types and each one's configuration space.
- **Search** (pure): ``evaluator`` the measurement contract; ``search`` the per-partition
  multi-pass multi-objective search, its surrogates in ``surrogate``, hypervolumes in
  ``hypervolume``, the resumable log in ``evaluation_log``.
- **Composition** (pure): ``compose`` partition results into per-instruction options for the
  Perseus solver; ``comparison`` the frontier against its baselines (the paper's metrics);
  ``study`` the saved study; ``workflow`` what ``powerlib kareus search|plan`` run.
- **The simulated partition evaluator**: ``sim_model`` (the evaluator), ``sim_fluid`` (the
  noise-free fluid model), ``sim_capping`` (repeated and power-capped runs), ``sim_params``
  (the GPUs' parameters).
- **On a device**: ``meter`` (:class:`~powerlib.kareus.meter.DeviceEvaluator`: partitions
  measured on real or simulated GPUs).
- **At run time**: ``launch`` (:class:`~powerlib.kareus.launch.LaunchControl` and
  :func:`~powerlib.kareus.launch.attach`: launch points from the session's instructions),
  ``launch_schedule`` (one stage's plan, checked against the loop's order), ``launch_records``
  (what the launch control did), ``sm_groups`` (SM-limited NCCL communicators).
- **In megatron-core**: ``megatron`` (the nanobatched transformer layer and its spec),
  ``megatron_run`` (one call's two nanobatches and autograd node), ``megatron_measure`` (a GPT's
  other components measured over ``torch.distributed``).
"""
