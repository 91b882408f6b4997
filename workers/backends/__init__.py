"""Device backends: what differs between NPU, CUDA and CPU, behind one small interface.

A backend is chosen from ``BackendConfig.deviceType`` ("auto" picks npu, then cuda, then cpu).
Each worker process owns one device; visibility is set through the environment by the
supervisor before the process starts (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES), so
inside the worker the device is always index 0.
"""
from __future__ import annotations

import importlib.util

import torch

from workers.backends.base import Backend
from workers.backends.cpu import CpuBackend
from workers.backends.cuda import CudaBackend
from workers.backends.npu import NpuBackend


def get_backend(device_type: str, threads: int = 0) -> Backend:
    """Return the backend for ``device_type`` ("auto", "npu", "cuda" or "cpu")."""
    if device_type == "auto":
        device_type = detect()
    if device_type == "npu":
        return NpuBackend()
    if device_type == "cuda":
        return CudaBackend()
    if device_type == "cpu":
        return CpuBackend(threads)
    raise ValueError(f"BackendConfig.deviceType: unknown device type {device_type!r} (auto, npu, cuda, cpu)")


def detect() -> str:
    """npu when torch_npu imports and sees a device, else cuda when available, else cpu."""
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401  (optional, the npu extra: only where it is installed)
            if torch.npu.is_available():
                return "npu"
        except Exception:  # a broken CANN install must not stop a CPU/CUDA host
            pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"
