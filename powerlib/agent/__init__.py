"""The node agent: a root daemon that owns the devices and leases them per job (docs/agent.md).

:mod:`powerlib.agent.transport` is the daemon (``powerlib agent serve``: its connections and their
limits), :mod:`powerlib.agent.listener` where it listens (the socket's folder, systemd),
:mod:`powerlib.agent.leases` the leases it grants and the restores that end them,
:mod:`powerlib.agent.protocol` its wire format, :mod:`powerlib.agent.authz` who may control what,
and :mod:`powerlib.agent.peer` who is on the other end of the socket. The client is the ``agent``
backend (:mod:`powerlib.backends.agent`). Importing this package starts nothing.
"""

from __future__ import annotations

__all__: list[str] = []
