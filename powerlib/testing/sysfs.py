"""Fake sysfs trees with kernel semantics, for testing code that uses the sysfs backend.

The builders lay out files and relative symlinks the way the kernel does (zone ids in hex, the
``class/powercap`` symlinks, ``cpuK/cpufreq`` → ``../cpufreq/policyN``), under any directory that
then stands in for the sysfs mount::

    make_powercap_tree(tmp_path, packages=2)
    make_cpufreq_tree(tmp_path, packages=2)
    kernel = FakeKernel(tmp_path)
    backend = SysfsBackend(Settings(sysfs_root=tmp_path), io=kernel)

Plain files accept anything, so :class:`FakeKernel` adds what the kernel enforces (ordering of
cpufreq limits, clamping, read-only attributes, the BIOS lock, integer parsing) and lets a test
inject any errno, which is the only way to test permission handling when tests run as root (root
ignores file modes). Its errors are raised as ``OSError`` below :class:`SysfsIO`'s translation, so
the backend's error mapping runs for real.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from powerlib.backends._sysfs_io import SysfsIO

__all__ = ["FakeKernel", "make_cpufreq_tree", "make_powercap_tree"]

_RAPL_DIR = "devices/virtual/powercap/intel-rapl"
_CPU_DIR = "devices/system/cpu"
_INTEL_RANGE_UJ = 262_143_328_850  # 0xFFFFFFFF x 2^-14 J
_AMD_RANGE_UJ = 65_532_610_987  # 0xFFFFFFFF x 2^-16 J (rounded as the kernel reports it)
_TIME_WINDOW_US = {"long_term": 999_424, "short_term": 2_440, "peak_power": 0}
_NO_TABLE_DRIVERS = frozenset({"intel_pstate", "intel_cpufreq", "amd-pstate", "amd-pstate-epp"})

_TEXT_ATTRS = frozenset(
    {
        "name",
        "scaling_governor",
        "scaling_available_governors",
        "scaling_driver",
        "scaling_available_frequencies",
        "related_cpus",
        "affected_cpus",
    }
)
_READ_ONLY_ATTRS = frozenset(
    {
        "name",
        "max_energy_range_uj",
        "cpuinfo_min_freq",
        "cpuinfo_max_freq",
        "scaling_cur_freq",
        "scaling_driver",
        "scaling_available_governors",
        "scaling_available_frequencies",
        "related_cpus",
        "affected_cpus",
        "physical_package_id",
        "die_id",
    }
)
_READ_ONLY_CONSTRAINT_RE = re.compile(
    r"^constraint_\d+_(name|max_power_uw|min_power_uw|max_time_window_us|min_time_window_us)$"
)
_ZONE_RE = re.compile(r"^intel-rapl:[0-9a-f]+(:[0-9a-f]+)?$")


def _put(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\n")


def _symlink(link: Path, target: Path) -> None:
    """Create ``link`` → ``target`` as a relative symlink (as sysfs does), replacing any old one."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


def _make_zone(zone_dir: Path, name: str, energy_uj: int, range_uj: int, is_enabled: bool) -> None:
    _put(zone_dir / "name", name)
    _put(zone_dir / "energy_uj", energy_uj)
    _put(zone_dir / "max_energy_range_uj", range_uj)
    _put(zone_dir / "enabled", int(is_enabled))


def make_powercap_tree(
    sysfs_root: Path,
    *,
    packages: int = 2,
    vendor: str = "intel",
    subzones: Sequence[str] | None = None,
    max_energy_range_uj: int | None = None,
    pl1_uw: int = 150_000_000,
    pl2_uw: int = 180_000_000,
    pl1_max_uw: int = 150_000_000,
    constraint_order: Sequence[str] = ("long_term", "short_term"),
    bios_locked: bool = False,
    start_energy_uj: int = 1_000_000,
    dies_per_package: int = 1,
) -> None:
    """Lay out an ``intel-rapl`` powercap tree under ``sysfs_root``.

    Real zone directories go under ``devices/virtual/powercap/intel-rapl/intel-rapl:<hex>/`` (sub
    zones ``intel-rapl:<hex>:<hex>`` inside them), with relative symlinks in ``class/powercap/``.
    Each zone has ``name``, ``energy_uj``, ``max_energy_range_uj`` and ``enabled``.

    Args:
        sysfs_root: Directory standing for the sysfs mount.
        packages: Number of CPU packages.
        vendor: ``"intel"`` (constraint files: ``constraint_N_name``, ``_power_limit_uw``,
            ``_time_window_us``, and ``_max_power_uw`` for ``long_term``) or ``"amd"`` (energy
            only, as Zen parts expose).
        subzones: Subzone names per package; default ``("dram",)`` for Intel, ``("core",)`` for AMD.
        max_energy_range_uj: Counter wrap range; default the vendor's usual value.
        pl1_uw: ``long_term`` limit (µW).
        pl2_uw: ``short_term`` (and ``peak_power``) limit (µW).
        pl1_max_uw: ``long_term`` ``max_power_uw`` (thermal spec power).
        constraint_order: Constraint names in index order (``constraint_0`` first).
        bios_locked: Write ``enabled`` = 0, as a BIOS-locked zone reads (pair with FakeKernel).
        start_energy_uj: Initial ``energy_uj`` of each package zone (subzones get a tenth).
        dies_per_package: More than 1 names zones ``package-N-die-D``, one top-level zone per die.

    Raises:
        ValueError: Unknown vendor or non-positive counts.
    """
    if vendor not in ("intel", "amd"):
        raise ValueError(f"vendor must be 'intel' or 'amd', got {vendor!r}")
    if packages < 1 or dies_per_package < 1:
        raise ValueError("packages and dies_per_package must be at least 1")
    is_intel = vendor == "intel"
    subzones = (("dram",) if is_intel else ("core",)) if subzones is None else tuple(subzones)
    range_uj = max_energy_range_uj or (_INTEL_RANGE_UJ if is_intel else _AMD_RANGE_UJ)
    root = Path(sysfs_root)
    control = root / _RAPL_DIR
    _put(control / "enabled", 1)
    _symlink(root / "class/powercap/intel-rapl", control)
    for zone_id in range(packages * dies_per_package):
        package, die = divmod(zone_id, dies_per_package)
        zone = f"intel-rapl:{zone_id:x}"
        name = f"package-{package}" if dies_per_package == 1 else f"package-{package}-die-{die}"
        _make_zone(control / zone, name, start_energy_uj, range_uj, not bios_locked)
        if is_intel:
            for i, constraint in enumerate(constraint_order):
                prefix = f"{control / zone}/constraint_{i}"
                limit_uw = pl1_uw if constraint == "long_term" else pl2_uw
                _put(Path(f"{prefix}_name"), constraint)
                _put(Path(f"{prefix}_power_limit_uw"), limit_uw)
                _put(Path(f"{prefix}_time_window_us"), _TIME_WINDOW_US.get(constraint, 0))
                if constraint == "long_term":
                    _put(Path(f"{prefix}_max_power_uw"), pl1_max_uw)
        _symlink(root / "class/powercap" / zone, control / zone)
        for j, sub_name in enumerate(subzones):
            sub = f"{zone}:{j:x}"
            sub_dir = control / zone / sub
            _make_zone(sub_dir, sub_name, start_energy_uj // 10, range_uj, not bios_locked)
            if is_intel:  # DRAM/core/uncore domains have PL1 only
                _put(sub_dir / "constraint_0_name", "long_term")
                _put(sub_dir / "constraint_0_power_limit_uw", 0)
                _put(sub_dir / "constraint_0_time_window_us", 976)
            _symlink(root / "class/powercap" / sub, sub_dir)


def make_cpufreq_tree(
    sysfs_root: Path,
    *,
    packages: int = 2,
    cpus_per_package: int = 2,
    cpus_per_policy: int = 2,
    driver: str = "acpi-cpufreq",
    freqs_khz: Sequence[int] = (1_200_000, 1_800_000, 2_400_000, 3_000_000),
    governors: Sequence[str] = ("performance", "powersave", "schedutil"),
    dies_per_package: int = 1,
) -> None:
    """Lay out cpufreq policies and CPU topology under ``sysfs_root``.

    Policies are ``devices/system/cpu/cpufreq/policyN`` named after their first CPU, as the kernel
    names them (``policy0``, ``policy2``, ... with two CPUs per policy). Limits start at the
    hardware bounds; ``scaling_cur_freq`` is the middle frequency; the first governor is active.
    ``scaling_available_frequencies`` (descending, as ``acpi-cpufreq`` lists it) is written only for
    table drivers: not for ``intel_pstate``, ``intel_cpufreq``, ``amd-pstate``, ``amd-pstate-epp``.

    Args:
        sysfs_root: Directory standing for the sysfs mount.
        packages: Number of CPU packages.
        cpus_per_package: CPUs per package (numbered consecutively).
        cpus_per_policy: CPUs sharing one policy; must divide the CPUs of a die.
        driver: ``scaling_driver``.
        freqs_khz: Frequencies (kHz); their min and max are the ``cpuinfo`` bounds.
        governors: ``scaling_available_governors``.
        dies_per_package: Dies per package, for ``topology/die_id``.

    Raises:
        ValueError: The counts do not divide evenly, or no frequency is given.
    """
    cpus_per_die, rest = divmod(cpus_per_package, max(dies_per_package, 1))
    if min(packages, cpus_per_policy, dies_per_package) < 1 or rest or not freqs_khz:
        raise ValueError("counts must be positive, dies must divide packages, freqs non-empty")
    if cpus_per_die % cpus_per_policy:
        raise ValueError(f"cpus_per_policy={cpus_per_policy} must divide {cpus_per_die} CPUs/die")
    root = Path(sysfs_root)
    lo_khz, hi_khz = min(freqs_khz), max(freqs_khz)
    ordered = sorted(set(freqs_khz))
    num_cpus = packages * cpus_per_package
    for first in range(0, num_cpus, cpus_per_policy):
        policy = root / _CPU_DIR / "cpufreq" / f"policy{first}"
        cpus = " ".join(str(cpu) for cpu in range(first, first + cpus_per_policy))
        values: dict[str, object] = {
            "cpuinfo_min_freq": lo_khz,
            "cpuinfo_max_freq": hi_khz,
            "scaling_min_freq": lo_khz,
            "scaling_max_freq": hi_khz,
            "scaling_cur_freq": ordered[len(ordered) // 2],
            "scaling_governor": governors[0] if governors else "performance",
            "scaling_available_governors": " ".join(governors),
            "scaling_driver": driver,
            "related_cpus": cpus,
            "affected_cpus": cpus,
        }
        if driver not in _NO_TABLE_DRIVERS:
            values["scaling_available_frequencies"] = (
                " ".join(str(f) for f in reversed(ordered)) + " "
            )
        for attr, value in values.items():
            _put(policy / attr, value)
        for cpu in range(first, first + cpus_per_policy):
            package, within = divmod(cpu, cpus_per_package)
            topology = root / _CPU_DIR / f"cpu{cpu}" / "topology"
            _put(topology / "physical_package_id", package)
            _put(topology / "die_id", within // cpus_per_die)
            _symlink(root / _CPU_DIR / f"cpu{cpu}" / "cpufreq", policy)


def _oserror(code: int, rel: str) -> OSError:
    return OSError(code, os.strerror(code), rel)


class FakeKernel(SysfsIO):
    """A :class:`SysfsIO` over a fake tree that behaves like the kernel, with error injection.

    Kernel semantics on writes:

    - read-only attributes (``name``, ``cpuinfo_*``, ``scaling_cur_freq``, ``max_energy_range_uj``,
      ``constraint_X_name``/``_max_power_uw``, ...) fail with ``EACCES``, even for root;
    - numeric attributes reject non-integers and negatives with ``EINVAL``; ``enabled`` takes 0/1;
    - ``energy_uj`` accepts an integer and ignores it (RAPL cannot reset its counter);
    - ``scaling_min_freq``/``scaling_max_freq`` are clamped to ``cpuinfo_*`` bounds, then a min
      above the current max (or a max below the current min) fails with ``EINVAL``;
      ``scaling_cur_freq`` follows the new limits;
    - ``scaling_governor`` must be one of ``scaling_available_governors`` (``EINVAL``);
    - in a BIOS-locked zone whose ``enabled`` reads 0, ``constraint_*`` and ``enabled`` writes fail
      with ``EACCES`` (the kernel logs "locked by BIOS, monitoring only").

    Args:
        root: The fake sysfs root.
        bios_locked_zones: Zone directory names (``"intel-rapl:0"``) that are BIOS-locked. Default:
            the zones under ``class/powercap`` whose ``enabled`` reads 0 now, which is what
            ``make_powercap_tree(bios_locked=True)`` builds.

    Attributes:
        writes: Every successful write, as ``(relative path as requested, value)``, in order.
        bios_locked_zones: The BIOS-locked zone names.
    """

    def __init__(self, root: Path | str, *, bios_locked_zones: Iterable[str] | None = None) -> None:
        super().__init__(root)
        self.writes: list[tuple[str, str]] = []
        self._injections: list[tuple[str, str, int]] = []
        if bios_locked_zones is None:
            class_dir = self.root / "class/powercap"
            found = os.listdir(class_dir) if class_dir.is_dir() else []
            bios_locked_zones = [
                z
                for z in found
                if _ZONE_RE.match(z) and self._peek(class_dir / z / "enabled") == "0"
            ]
        self.bios_locked_zones = set(bios_locked_zones)

    def inject(self, pattern: str, op: str, err: int) -> None:
        """Make every ``op`` (``"read"`` or ``"write"``) of a matching path fail with errno ``err``.

        ``pattern`` is an ``fnmatch`` pattern matched against the relative path as requested and
        as resolved (``*`` also matches ``/``), e.g. ``"*/energy_uj"``.
        """
        if op not in ("read", "write"):
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        self._injections.append((pattern, op, err))

    def clear_injections(self) -> None:
        """Remove every injected error."""
        self._injections.clear()

    def advance_energy(self, zone_dir_name: str, delta_uj: int) -> None:
        """Add ``delta_uj`` to a zone's ``energy_uj``, wrapping at ``max_energy_range_uj``.

        Args:
            zone_dir_name: Zone directory name, e.g. ``"intel-rapl:0"`` or ``"intel-rapl:0:0"``.
            delta_uj: Energy consumed since the last update (µJ, non-negative).
        """
        zone = self._zone_dir(zone_dir_name)
        cur_uj = int(self._peek(zone / "energy_uj") or 0)
        range_uj = int(self._peek(zone / "max_energy_range_uj") or 0)
        new_uj = cur_uj + delta_uj
        (zone / "energy_uj").write_text(f"{new_uj % range_uj if range_uj else new_uj}\n")

    # -- SysfsIO hooks --------------------------------------------------------------------------

    def _raw_read(self, rel: str, path: Path) -> str:
        self._check_injected(rel, path, "read")
        return super()._raw_read(rel, path)

    def _raw_write(self, rel: str, path: Path, value: str) -> None:
        self._check_injected(rel, path, "write")
        if not path.exists():
            raise _oserror(errno.ENOENT, rel)
        attr, text = path.name, value.strip()
        if attr in _READ_ONLY_ATTRS or _READ_ONLY_CONSTRAINT_RE.match(attr):
            raise _oserror(errno.EACCES, rel)
        number = 0
        if attr not in _TEXT_ATTRS:
            try:
                number = int(text)
            except ValueError:
                raise _oserror(errno.EINVAL, rel) from None
            if number < 0 or (attr == "enabled" and number not in (0, 1)):
                raise _oserror(errno.EINVAL, rel)
        zone = path.parent
        if (
            zone.name in self.bios_locked_zones
            and (attr.startswith("constraint_") or attr == "enabled")
            and self._peek(zone / "enabled") == "0"
        ):
            raise _oserror(errno.EACCES, rel)
        if attr == "energy_uj":
            pass  # RAPL has no reset: the kernel accepts the write and changes nothing
        elif attr in ("scaling_min_freq", "scaling_max_freq"):
            self._write_freq_limit(rel, path, number)
        elif attr == "scaling_governor":
            if text not in (self._peek(zone / "scaling_available_governors") or "").split():
                raise _oserror(errno.EINVAL, rel)
            super()._raw_write(rel, path, text)
        else:
            super()._raw_write(rel, path, text if attr in _TEXT_ATTRS else str(number))
        self.writes.append((rel, value))

    # -- helpers ---------------------------------------------------------------------------------

    def _write_freq_limit(self, rel: str, path: Path, freq_khz: int) -> None:
        policy = path.parent
        bounds = [
            int(self._peek(policy / f) or 0) for f in ("cpuinfo_min_freq", "cpuinfo_max_freq")
        ]
        freq_khz = min(max(freq_khz, bounds[0]), bounds[1])
        cur_min = int(self._peek(policy / "scaling_min_freq") or bounds[0])
        cur_max = int(self._peek(policy / "scaling_max_freq") or bounds[1])
        if path.name == "scaling_min_freq":
            if freq_khz > cur_max:
                raise _oserror(errno.EINVAL, rel)
            cur_min = freq_khz
        else:
            if freq_khz < cur_min:
                raise _oserror(errno.EINVAL, rel)
            cur_max = freq_khz
        super()._raw_write(rel, path, str(freq_khz))
        cur_path = policy / "scaling_cur_freq"
        if cur_path.exists():
            cur_khz = int(self._peek(cur_path) or cur_min)
            cur_path.write_text(f"{min(max(cur_khz, cur_min), cur_max)}\n")

    def _check_injected(self, rel: str, path: Path, op: str) -> None:
        resolved = os.path.relpath(path, self.resolve("."))
        for pattern, injected_op, code in self._injections:
            if injected_op == op and (
                fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(resolved, pattern)
            ):
                raise _oserror(code, rel)

    def _zone_dir(self, zone_dir_name: str) -> Path:
        linked = self.root / "class/powercap" / zone_dir_name
        if linked.exists():
            return linked
        parts = zone_dir_name.split(":")
        real = self.root / _RAPL_DIR / ":".join(parts[:2])
        return real / zone_dir_name if len(parts) > 2 else real

    @staticmethod
    def _peek(path: Path) -> str | None:
        """The stripped contents of ``path`` without semantics or injection; ``None`` if absent."""
        try:
            return path.read_text().strip()
        except OSError:
            return None
