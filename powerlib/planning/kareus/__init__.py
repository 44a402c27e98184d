"""Kareus: joint per-partition launch point, SM share and clock, composed into Perseus plans.

``shapes`` holds the reference models' layer shapes and the stage parallelism; ``partition_types``
the operation, partition and configuration types; ``partition`` builds a stage's partition types
from the shapes and gives each its configuration space. ``search`` runs the per-partition
multi-pass multi-objective search (its surrogates in ``surrogate``, hypervolumes in
``hypervolume``, the resumable log in ``evaluation_log``); ``compose`` turns partition results into
per-instruction options for the Perseus solver (docs/kareus.md).
"""
