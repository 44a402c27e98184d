"""``powerlib exporter``: Prometheus metrics of the node's devices (HTTP, or a textfile)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from powerlib.cli.options import Number, Options, OutputPath, open_backend_for

__all__ = ["exporter"]


@click.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9464,
    show_default=True,
    help="HTTP port to serve /metrics on (0: any free port, printed).",
)
@click.option(
    "--addr",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. The default serves this host only; to let Prometheus on other "
    "hosts scrape, give this node's IP, or 0.0.0.0 for every interface (firewall the port). "
    "The metrics are read-only: no request changes anything.",
)
@click.option(
    "--timeout-s",
    type=Number(min=0.1, max=300.0),
    default=5.0,
    show_default=True,
    help="Seconds a client has to send its whole request; then it is closed. Requests are "
    "answered by 8 threads, never a thread per connection.",
)
@click.option(
    "--interval-s",
    type=Number(min=0.05, max=3600.0),
    default=1.0,
    show_default=True,
    help="Seconds between device reads (a scrape serves the latest).",
)
@click.option(
    "--textfile",
    type=OutputPath(),
    default=None,
    help="Write the metrics to this file for node_exporter's textfile collector (no HTTP).",
)
@click.option("--once", is_flag=True, help="With --textfile: write once and exit.")
@click.option(
    "--device",
    "selectors",
    metavar="I",
    multiple=True,
    help="Device index or id (repeatable; default: every device).",
)
@click.pass_obj
def exporter(
    opts: Options,
    port: int,
    addr: str,
    timeout_s: float,
    interval_s: float,
    textfile: str | None,
    once: bool,
    selectors: tuple[str, ...],
) -> None:
    """Serve device energy, power, clocks and limits to Prometheus; read-only.

    \b
    powerlib exporter --port 9464
    powerlib exporter --textfile /var/lib/node_exporter/textfile/powerlib.prom
    """  # noqa: D301 - "\b" is click's keep-these-lines marker (a backspace), not "\\b"
    from powerlib.exporter import Exporter  # noqa: PLC0415 - a command loads only what it runs (fast --help)

    if once and textfile is None:
        raise click.UsageError("--once needs --textfile")
    backend = open_backend_for(opts)
    try:
        devices = [backend.device(s) for s in selectors] if selectors else None
        exp = Exporter(
            devices,
            backend=backend,
            port=None if textfile is not None else port,
            addr=addr,
            interval_s=interval_s,
            textfile=textfile,
            sessions=False,
            timeout_s=timeout_s,
        )
        if once:
            exp.start()
            exp.close()
            click.echo(f"wrote {textfile}", err=True)
            return
        stop = threading.Event()

        def handler(signum: int, _frame: Any) -> None:
            stop.set()

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        with exp:
            where = f"file {textfile}" if textfile else f"http://{addr}:{exp.port}/metrics"
            n = len(exp.sampler.devices) if exp.sampler else 0
            click.echo(
                f"powerlib exporter: {n} device(s), every {interval_s:g} s, at {where}", err=True
            )
            while not stop.wait(3600):
                pass
        for sig, h in old.items():
            signal.signal(sig, h)
    finally:
        backend.close()
