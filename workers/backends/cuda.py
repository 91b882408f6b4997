"""CUDA backend: one process sees one GPU through CUDA_VISIBLE_DEVICES."""
from __future__ import annotations

import torch

from workers.backends.base import Backend
from workers.backends.int8 import Int8Kernel


class CudaBackend(Backend):
    name = "cuda"

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():  # no CUDA context is created here
            return "deviceType is cuda but torch sees no CUDA device (check CUDA_VISIBLE_DEVICES and the torch build)"
        return None

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def setup(self) -> None:
        if why := self.unavailable():
            raise RuntimeError(why)
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True

    def bind_thread(self) -> None:
        torch.cuda.set_device(0)  # the current device is per thread

    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def int8_kernel(self):
        # Portable: dequantise then matmul (not measured on a GPU in this project).
        return Int8Kernel()

    def free_memory(self) -> int:
        free, _total = torch.cuda.mem_get_info()
        return free

    def describe(self) -> str:
        return f"cuda ({torch.cuda.get_device_name(0)})"
