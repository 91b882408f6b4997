"""Ascend NPU backend through torch_npu: one process sees one NPU via ASCEND_RT_VISIBLE_DEVICES.

Exercised: nothing here has run on an NPU in this project's CI (no Ascend hardware is
available); the CPU and CUDA backends run the same engine and model code. What this module
relies on, from torch_npu's documented API (shared/reference/torch-npu.md): ``import torch_npu``
registers the ``npu`` device, ``torch.npu.set_device`` and ``torch.npu.mem_get_info``. The model uses portable torch ops, which torch_npu implements;
attention uses torch_npu's fused paged-attention ops (workers/attention/npu.py, checked
on CPU against a fake torch_npu that implements their documented contracts).
"""
from __future__ import annotations

import torch

from workers.backends.base import Backend
from workers.backends.int8 import NpuInt8Kernel


class NpuBackend(Backend):
    name = "npu"

    def unavailable(self) -> str | None:
        try:  # torch_npu is optional (the npu extra): imported only by an NPU worker
            import torch_npu  # noqa: F401  (registers the npu device)
        except ImportError:
            return "deviceType is npu but torch_npu is not installed: pip install '.[npu]'"
        if not torch.npu.is_available():
            return "deviceType is npu but no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES)"
        return None

    def device_count(self) -> int:
        return torch.npu.device_count()

    def setup(self) -> None:
        if why := self.unavailable():
            raise RuntimeError(why)
        torch.npu.set_device(0)

    def bind_thread(self) -> None:
        torch.npu.set_device(0)  # the current device is per thread

    def device(self) -> torch.device:
        return torch.device("npu", 0)

    def int8_kernel(self):
        """torch_npu.npu_weight_quant_batchmatmul when this torch_npu has it, else None (refused)."""
        try:
            import torch_npu
        except ImportError:
            return None
        if not hasattr(torch_npu, "npu_weight_quant_batchmatmul"):
            return None
        return NpuInt8Kernel()

    def prepare_model(self, model: torch.nn.Module) -> None:
        # Mixture-of-experts layers: torch_npu's fused routing and grouped products (npu_moe.py).
        from workers.backends import npu_moe
        npu_moe.attach(model)

    def free_memory(self) -> int:
        free, _total = torch.npu.mem_get_info()
        return free
