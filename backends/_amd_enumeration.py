"""Which AMD GPUs this process sees, and how they are numbered (the HIP order).

Index spaces. Three numberings of the same GPUs disagree on some nodes (on an MI350X node HIP's
device 0 is amd-smi's GPU 3):

* **amd-smi index**: the position in ``amdsmi_get_processor_handles()``, which is PCI BDF order.
  Only ``details()["amdsmi_index"]`` uses it.
* **HIP index**: what ``HIP_VISIBLE_DEVICES``, ``torch.cuda`` (``cuda:N`` on ROCm) and the
  ``--device N`` of powerlib use. It is read from ``amdsmi_get_gpu_enumeration_info()["hip_id"]``
  (ROCm 6.4+); without that call the handles are sorted by KFD node id
  (``amdsmi_get_gpu_kfd_info()["node_id"]``), which is the order the ROCr runtime enumerates in;
  failing both, BDF order is used and a warning says so. ``details()["device_order"]`` names the
  source.
* The OAM slot (``asic_info["oam_id"]``) is not used.

Visibility follows the runtime: ``ROCR_VISIBLE_DEVICES`` is applied first (ordinals in HIP order,
or UUIDs), then ``HIP_VISIBLE_DEVICES`` relative to what ROCr left. UUID tokens are matched against
HIP's UUID (``hip_uuid``, ``GPU-…``) when amdsmi reports it, else against amd-smi's UUID. Set to the
empty string, either variable hides every GPU. ``DeviceInfo.index`` is the position in the final
list, so device 0 is the GPU the framework calls device 0. ``device_id`` is amd-smi's UUID
(the PCI BDF when the UUID cannot be read or is shared by several devices).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from powerlib.backends import _amd_api as api
from powerlib.backends._visible import select_visible
from powerlib.config import Settings

__all__ = ["Enumeration", "Gpu", "enumerate_gpus"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Gpu:
    """Identity of one GPU, read for every handle (visible or not)."""

    handle: Any
    smi_index: int  # amd-smi order (PCI BDF)
    bdf: str
    uuid: str | None  # amd-smi's UUID
    hip_uuid: str | None
    hip_id: int | None
    device_id: str

    @property
    def visibility_uuid(self) -> str:
        """What ``*_VISIBLE_DEVICES`` UUID tokens are matched against."""
        return self.hip_uuid or self.uuid or self.bdf


@dataclass(frozen=True, slots=True)
class Enumeration:
    gpus: list[Gpu]  # every GPU, in HIP order
    visible: list[Gpu]  # after ROCR_VISIBLE_DEVICES, then HIP_VISIBLE_DEVICES
    order_source: str


def enumerate_gpus(smi: Any, settings: Settings) -> Enumeration:
    handles = list(api.call(smi, "amdsmi_get_processor_handles", operation="enumerate") or [])
    raw = []
    for i, handle in enumerate(handles):
        bdf = api.text(api.call(smi, "amdsmi_get_gpu_device_bdf", handle, operation="enumerate"))
        uuid = api.text(api.soft(smi, "amdsmi_get_gpu_device_uuid", handle))
        info = api.soft(smi, "amdsmi_get_gpu_enumeration_info", handle) or {}
        raw.append((handle, i, bdf or f"amdsmi-{i}", uuid, info))
    uuid_counts: dict[str | None, int] = {}
    for *_, uuid, _info in raw:
        uuid_counts[uuid] = uuid_counts.get(uuid, 0) + 1
    gpus = [
        Gpu(
            handle=handle,
            smi_index=i,
            bdf=bdf,
            uuid=uuid,
            hip_uuid=api.text(info.get("hip_uuid")),
            hip_id=api.int_or_none(info.get("hip_id")),
            device_id=uuid if uuid is not None and uuid_counts[uuid] == 1 else bdf,
        )
        for handle, i, bdf, uuid, info in raw
    ]
    ordered, source = _hip_order(smi, gpus)
    rocr = select_visible(
        settings.rocr_visible_devices,
        [g.visibility_uuid for g in ordered],
        "ROCR_VISIBLE_DEVICES",
    )
    after_rocr = [ordered[i] for i in rocr]
    hip = select_visible(
        settings.hip_visible_devices,
        [g.visibility_uuid for g in after_rocr],
        "HIP_VISIBLE_DEVICES",
    )
    return Enumeration(ordered, [after_rocr[i] for i in hip], source)


def _hip_order(smi: Any, gpus: list[Gpu]) -> tuple[list[Gpu], str]:
    """The GPUs in HIP order, and where that order came from (see the module docstring)."""
    hip_ids = [g.hip_id for g in gpus]
    if None not in hip_ids and len(set(hip_ids)) == len(gpus):
        source = "hip_id (amdsmi_get_gpu_enumeration_info)"
        ordered = sorted(gpus, key=lambda g: g.hip_id or 0)
    else:
        nodes = [
            api.int_or_none(
                (api.soft(smi, "amdsmi_get_gpu_kfd_info", g.handle) or {}).get("node_id")
            )
            for g in gpus
        ]
        if None not in nodes and len(set(nodes)) == len(gpus):
            source = "KFD node id (amdsmi_get_gpu_kfd_info)"
            by_node = dict(zip((id(g) for g in gpus), nodes))
            ordered = sorted(gpus, key=lambda g: by_node[id(g)] or 0)
        else:
            source = "PCI BDF (amd-smi order)"
            ordered = list(gpus)
            if len(gpus) > 1:
                logger.warning(
                    "amdsmi reports neither HIP ids nor KFD node ids: GPUs are numbered in PCI BDF "
                    "order, which HIP may not follow; list GPU UUIDs in HIP_VISIBLE_DEVICES to "
                    "be sure which GPU is which"
                )
    logger.info("amd: %d GPU(s), HIP order from %s", len(gpus), source)
    return ordered, source
