"""What one Prometheus scrape of the exporter costs, for 8 devices.

Run::

    python3 benchmarks/exporter_scrape.py --devices 8 --out benchmarks/results/exporter_scrape.json

Eight simulated A100s, sampled every second by the exporter's thread. Two figures:

* **render**: ``Exporter.render()`` (the text format, built from the sampler's cache; no device
  call), median and p99 over ``--scrapes`` calls;
* **HTTP scrape**: ``GET /metrics`` on 127.0.0.1, the same count, through ``urllib``.

Prints one JSON object. Exits 1 if the median render is not below ``--limit-ms`` (5 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from powerlib.backends.simulated import SimulatedBackend
from powerlib.config import Settings
from powerlib.exporter import Exporter


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--scrapes", type=int, default=300)
    ap.add_argument("--limit-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as state:
        backend = SimulatedBackend(
            Settings(state_dir=Path(state), sim_gpus=args.devices), persist=False
        )
        with Exporter(backend=backend, port=0, addr="127.0.0.1", interval_s=1.0) as exp:
            render_ms, http_ms = [], []
            size = len(exp.render())
            for _ in range(args.scrapes):
                t0 = time.perf_counter()
                exp.render()
                render_ms.append((time.perf_counter() - t0) * 1e3)
            url = f"http://127.0.0.1:{exp.port}/metrics"
            urllib.request.urlopen(url, timeout=10).read()  # the first request sets things up
            for _ in range(args.scrapes):
                t0 = time.perf_counter()
                urllib.request.urlopen(url, timeout=10).read()
                http_ms.append((time.perf_counter() - t0) * 1e3)
            series = sum(
                1
                for line in exp.render().decode().splitlines()
                if line and not line.startswith("#")
            )
    med = statistics.median(render_ms)
    out = {
        "benchmark": "exporter_scrape",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "devices": args.devices,
        "scrapes": args.scrapes,
        "series": series,
        "series_per_device": round(series / args.devices, 2),
        "body_bytes": size,
        "render_ms": {"median": round(med, 4), "p99": round(_pct(render_ms, 0.99), 4)},
        "http_scrape_ms": {
            "median": round(statistics.median(http_ms), 4),
            "p99": round(_pct(http_ms, 0.99), 4),
        },
        "limit_ms": args.limit_ms,
        "ok": med < args.limit_ms,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
