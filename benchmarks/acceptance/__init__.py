"""The GPU acceptance run in parts (``benchmarks/gpu_acceptance.py`` runs them in order).

``harness``: the report (checks, JSON), the run's scale, what the parts share (:class:`Rig`) and
the loop around one part. ``readings``: the device reads the parts share (lock state, landing,
counter windows). ``work``: the device opened, and the work it runs (a matmul and a transformer
layer stack on a real GPU, the simulated GPU's work units in ``--smoke``). Then one module per
part, ``part_a_environment`` to ``part_g_restore``, each with ``KEY``, ``TITLE`` and ``run``;
each imports the library names it uses at its top (the only place to mend when one moves:
``python3 -m mypy --strict --follow-imports=silent --ignore-missing-imports benchmarks/acceptance``
names each one that moved).
"""
