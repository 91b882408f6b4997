"""The KV cache: its tensors, its size, its allocation, and the block tables that index it.

Layout and block tables. Per layer the cache holds ``num_blocks`` blocks of ``block_size`` token
positions (K and V, ``n_kv_heads`` x ``head_dim`` each; the element order is the attention
implementation's: [blocks, kv_heads, block_size, head_dim] for paged.py and cpu.py,
[blocks, block_size, kv_heads, head_dim] for npu.py). A block id is in [0, num_blocks). A
sequence's block table lists its blocks in position order: position p lives in block
``table[p // block_size]`` at offset ``p % block_size``. The engine's ``BlockManager``
(workers/engine/block_manager.py) owns which blocks a sequence holds and is built from the same
(num_blocks, block_size); the attention objects only read the tables it hands out.

Sizing. A token slot costs ``bytes_per_slot`` (K and V of every layer); a block ``block_size``
slots. The budget is ``cpuMemSize`` GiB on the CPU (1 unless configured: never most of the
host's RAM by default), ``npuMemSize`` GB on an accelerator, or (-1) a fraction of its free
memory; the cache gets as many whole blocks as the budget holds (at least one). A
tensor-parallel instance allocates what its smallest rank holds (workers/engine/assembly.py).

Allocation. ``allocate`` builds the attention object that owns the tensors; ``tensors`` makes
them: zero-filled (masked positions are multiplied by 0, and uninitialised memory may hold NaN),
and on the CPU backed by an anonymous mmap, so pages become resident only once written.
"""
from __future__ import annotations

import math
import mmap
from typing import Callable

import torch

from mindie.contract.spec import WorkerSpec

KvShape = tuple[int, int, int]  # (num_layers, n_kv_heads, head_dim) of this rank


def bytes_per_slot(num_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token position: K and V of every layer."""
    return 2 * num_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def bytes_per_block(attention_cls: type, kv_shape: KvShape, dtype: torch.dtype, block_size: int) -> int:
    return block_size * attention_cls.bytes_per_slot(*kv_shape, dtype)


def budget_bytes(spec: WorkerSpec, device_type: str, free_memory: Callable[[], int], fraction: float = 0.8) -> int:
    """Bytes to give the KV cache on a ``device_type`` ("cpu", "cuda", "npu") device:
    cpuMemSize GiB on the CPU (0 is read as 1), else npuMemSize GB, or (-1) ``fraction`` of
    ``free_memory()`` (the backend's probe)."""
    if device_type == "cpu":
        return int((spec.cpu_mem_gb if spec.cpu_mem_gb > 0 else 1.0) * (1 << 30))
    if spec.npu_mem_gb > 0:
        return int(spec.npu_mem_gb * (1 << 30))
    return int(free_memory() * fraction)


def blocks_in(budget: int, block_bytes: int) -> int:
    """Whole blocks in ``budget`` bytes, at least one."""
    return max(1, budget // block_bytes)


def bookkeeping_blocks(max_batch_size: int, max_seq_len: int, block_size: int) -> int:
    """Blocks of a cache that holds no tensors (the null model): every slot at full length."""
    return max(64, (max_batch_size * max_seq_len) // block_size + 1)


def tensors(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            host_mmap: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(K, V): one zero-filled ``shape`` tensor per layer each. ``host_mmap=False``: plain
    ``torch.zeros`` on every device."""
    make = zeros if host_mmap else (lambda s, d, dev: torch.zeros(s, dtype=d, device=dev))
    return [make(shape, dtype, device) for _ in range(num_layers)], [make(shape, dtype, device) for _ in range(num_layers)]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor; on the CPU backed by an anonymous mmap (resident once written)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(1, nbytes))
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def copy_blocks(attn, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (source, destination) in every layer's K and V tensors of ``attn`` (a
    workers.attention.Attention: every layout keeps the block id first): a partial prefix hit's
    content, whose slots past the hit the step then overwrites."""
    for cache in (*attn.k_cache, *attn.v_cache):
        for src, dst in pairs:
            cache[dst].copy_(cache[src])


def allocate(attention_cls: type, kv_shape: KvShape, dtype: torch.dtype, num_blocks: int, block_size: int,
             device: torch.device):
    """The attention object that owns a cache of ``num_blocks`` blocks (workers.attention.Attention)."""
    layers, kv_heads, head_dim = kv_shape
    return attention_cls(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)
