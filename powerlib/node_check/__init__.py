"""``powerlib check``: is this node ready for powerlib? (docs/real-gpu.md §8).

:mod:`powerlib.node_check.check` checks an open backend and each of its devices
(:func:`~powerlib.node_check.check.check_node`; :func:`~powerlib.node_check.check.check_settings`
opens the backend first), :mod:`powerlib.node_check.report` is what it found
(``powerlib.check.v1``), and :mod:`powerlib.node_check.landing` measures the clock-change
landing latency under a load, the one part that changes clocks (through a
:class:`~powerlib.control.ControlSession`, always restored). The energy counter's period and
read cost come from the engine (:func:`~powerlib.measurement.counter_period.measure_counter`).
"""
