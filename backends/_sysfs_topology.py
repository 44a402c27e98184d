"""Where the sysfs backend's devices are: RAPL package zones and cpufreq policies.

:func:`scan` lists, under the injected root, the top-level powercap zones named ``package-N`` (or
``package-N-die-D``) and the cpufreq policies, each policy assigned to the package (and die) of
its CPUs through ``topology/physical_package_id`` (``die_id`` only where RAPL has per-die zones).
:class:`Topology` holds what it found and one line saying so; :mod:`powerlib.backends.sysfs` turns
each ``(package, die)`` into a device. The choices (zone names, ids in hex, package 0 when the
topology is missing, the bind-mount fallback directory) are documented in that module's docstring.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from powerlib.backends._sysfs_io import SysfsIO, soft

__all__ = ["Policy", "Topology", "Zone", "scan"]

logger = logging.getLogger(__name__)

_POWERCAP_DIRS = ("class/powercap", "devices/virtual/powercap/intel-rapl")
_CPU_DIR = "devices/system/cpu"
_CPUFREQ_DIR = f"{_CPU_DIR}/cpufreq"
_ZONE_RE = re.compile(r"^intel-rapl:([0-9a-f]+)$")
_PACKAGE_NAME_RE = re.compile(r"^package-(\d+)(?:-die-(\d+))?$")
_POLICY_RE = re.compile(r"^policy(\d+)$")


@dataclass(frozen=True, slots=True)
class Zone:
    """One top-level RAPL zone named ``package-N`` or ``package-N-die-D``."""

    rel: str  # e.g. "class/powercap/intel-rapl:0"
    dir_name: str
    name: str
    package: int
    die: int  # 0 unless the zone is named package-N-die-D
    is_per_die: bool


@dataclass(frozen=True, slots=True)
class Policy:
    """One cpufreq policy, with the package (and die) of its CPUs and its clock limits (kHz)."""

    rel: str  # e.g. "devices/system/cpu/cpufreq/policy0"
    name: str
    cpus: tuple[int, ...]
    package: int
    die: int
    cpuinfo_min_khz: int
    cpuinfo_max_khz: int
    table_khz: tuple[int, ...]
    driver: str | None


def _parse_cpu_list(text: str) -> tuple[int, ...]:
    """Parse ``"0 1 2"`` or ``"0-3,8"`` into CPU numbers."""
    cpus: list[int] = []
    for token in text.replace(",", " ").split():
        first, _, last = token.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def _discover_zones(io: SysfsIO) -> tuple[str, list[Zone], int]:
    """Top-level RAPL package zones: (directory searched, zones, number of top-level zones)."""
    base, entries = _POWERCAP_DIRS[0], []
    for candidate in _POWERCAP_DIRS:
        entries = [e for e in io.listdir(candidate) if _ZONE_RE.match(e)]
        if entries:
            base = candidate
            break
    zones = []
    for entry in sorted(entries, key=lambda e: int(e.rpartition(":")[2], 16)):
        rel = f"{base}/{entry}"
        name = soft(io.read_text, f"{rel}/name") or ""
        match = _PACKAGE_NAME_RE.match(name)
        if match is None:
            logger.debug("skipping powercap zone %s (%r): not a CPU package", entry, name)
            continue
        zones.append(
            Zone(rel, entry, name, int(match[1]), int(match[2] or 0), match[2] is not None)
        )
    return base, zones, len(entries)


def _discover_policies(io: SysfsIO, die_packages: set[int]) -> list[Policy]:
    """Cpufreq policies, each assigned to the package (and die) of its CPUs."""
    policies = []
    for entry in io.listdir(_CPUFREQ_DIR):
        match = _POLICY_RE.match(entry)
        rel = f"{_CPUFREQ_DIR}/{entry}"
        lo_khz, hi_khz = (
            soft(io.read_int, f"{rel}/cpuinfo_min_freq"),
            soft(io.read_int, f"{rel}/cpuinfo_max_freq"),
        )
        if match is None or lo_khz is None or hi_khz is None:
            continue
        cpu_text = soft(io.read_text, f"{rel}/related_cpus")
        cpu_text = cpu_text or soft(io.read_text, f"{rel}/affected_cpus")
        cpus = _parse_cpu_list(cpu_text or match[1]) or (int(match[1]),)
        topology = f"{_CPU_DIR}/cpu{cpus[0]}/topology"
        package = max(soft(io.read_int, f"{topology}/physical_package_id") or 0, 0)
        die = 0
        if package in die_packages:  # dies matter only where RAPL has per-die zones
            die = max(soft(io.read_int, f"{topology}/die_id") or 0, 0)
        table = (soft(io.read_text, f"{rel}/scaling_available_frequencies") or "").split()
        policies.append(
            Policy(
                rel=rel,
                name=entry,
                cpus=cpus,
                package=package,
                die=die,
                cpuinfo_min_khz=lo_khz,
                cpuinfo_max_khz=hi_khz,
                table_khz=tuple(sorted({int(t) for t in table if t.isdigit()})),
                driver=soft(io.read_text, f"{rel}/scaling_driver"),
            )
        )
    return sorted(policies, key=lambda p: int(p.name[len("policy") :]))


@dataclass(frozen=True, slots=True)
class Topology:
    """What :func:`scan` found."""

    zones: list[Zone]
    policies: list[Policy]
    reason: str  # one line: what was found, or what is missing, under which root

    @property
    def packages(self) -> list[tuple[int, int]]:
        """``(package, die)`` keys of every device, in index order."""
        keys = {(z.package, z.die) for z in self.zones}
        keys |= {(p.package, p.die) for p in self.policies}
        return sorted(keys)


def scan(io: SysfsIO) -> Topology:
    """Find the RAPL package zones and cpufreq policies under ``io.root``."""
    base, zones, num_top_zones = _discover_zones(io)
    policies = _discover_policies(io, {z.package for z in zones if z.is_per_die})
    if zones or policies:
        reason = (
            f"found {len(zones)} RAPL package zone(s) and {len(policies)} cpufreq policy(ies) "
            f"under {io.root}"
        )
    else:
        what = "RAPL package zones" if num_top_zones else "powercap zones"
        reason = (
            f"no {what} under {io.root / base} and no cpufreq policies under "
            f"{io.root / _CPUFREQ_DIR}"
        )
    return Topology(zones, policies, reason)
