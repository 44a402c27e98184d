"""Kareus: joint per-partition launch point, SM share and clock, composed into Perseus plans.

``partition`` builds the partition types of a transformer layer from its shapes; ``search`` runs
the per-partition multi-pass multi-objective search; ``compose`` turns partition results into
per-instruction options for the Perseus solver (kareus.md).
"""
