"""Hardware backends (installed as ``powerlib.backends``).

One module per vendor interface: ``nvidia`` (NVML through nvidia-ml-py), ``amd`` (amdsmi),
``sysfs`` (Linux powercap/RAPL and cpufreq, no eBPF, no vendor library) and ``simulated``.
Nothing is imported here: the registry imports only the backend it opens.
"""
