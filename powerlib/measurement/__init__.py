"""The energy engine: device counters to the energy of spans, windows and labels.

One way of turning timestamped counter reads into energy, shared by every product above it
(docs/measurement.md): :mod:`~powerlib.measurement.sampler` (one device's reads, for the
session's profile and apply phases), :mod:`~powerlib.measurement.reader` (which devices
``powerlib.measure`` reads, and its reading thread), :mod:`~powerlib.measurement.timeline`
(``E(t)``: counter updates located in time), :mod:`~powerlib.measurement.attribution` (power
per label by least squares), :mod:`~powerlib.measurement.markers` (stream markers without a
synchronize) and :mod:`~powerlib.measurement.counter_period` (the counter's update period and
read cost). The engine imports none of its users: the runtime, the ``powerlib.measure`` API
(:mod:`powerlib.measure_api`), the exporter (:mod:`powerlib.exporter`) and the node check
(:mod:`powerlib.node_check`) import it.
"""
