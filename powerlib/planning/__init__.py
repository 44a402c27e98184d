"""Pure planning code: pipeline schedules, profiles, cost models and the frontier solvers.

Nothing here touches a device, reads an environment variable or imports torch: graphs and
profiles go in, frontiers and plans come out.
"""
