"""The NPU attention path on CPU: a fake ``torch_npu`` whose ops are pure-torch references
that assert the documented contracts (shared/reference/torch-npu.md §2), so the real
NpuPagedAttention code runs here and must agree with the portable PagedAttention."""
from __future__ import annotations

import types

import pytest
import torch

from workers.attention.npu import NpuPagedAttention
from workers.attention.paged import PagedAttention


def _attend(q, k, v, q_pos, scale):
    """q [Q, H, D] at absolute positions q_pos; k, v [K, Hkv, D] at positions 0..K-1."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _fake_torch_npu(calls: list[str]) -> types.ModuleType:
    mod = types.ModuleType("torch_npu")

    def reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        calls.append("reshape_and_cache")
        assert slot_indices.dtype == torch.int32 and key.is_contiguous() and value.is_contiguous()
        assert key_cache.dim() == 4 and key.shape[1:] == key_cache.shape[2:]  # [NB, BS, KVN, D]
        kvn, d = key_cache.shape[2:]
        key_cache.view(-1, kvn, d)[slot_indices.long()] = key
        value_cache.view(-1, kvn, d)[slot_indices.long()] = value

    def gather(cache, table_row, n):
        bs = cache.shape[1]
        pos = torch.arange(n)
        return cache.view(cache.shape[0], bs, *cache.shape[2:])[table_row[pos // bs].long(), pos % bs]

    def paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                        context_lens, out):
        calls.append("paged_attention")
        assert block_table.dtype == torch.int32 and context_lens.dtype == torch.int32
        assert context_lens.device.type == "cpu" and query.shape[1] == num_heads
        assert num_heads % num_kv_heads == 0 and scale_value != 1.0
        for b in range(query.shape[0]):
            n = int(context_lens[b])
            k, v = gather(key_cache, block_table[b], n), gather(value_cache, block_table[b], n)
            out[b] = _attend(query[b:b + 1], k, v, torch.tensor([n - 1]), scale_value)[0].to(out.dtype)

    def fia(query, key, value, *, atten_mask, actual_seq_lengths, actual_seq_lengths_kv, block_table, block_size,
            num_heads, num_key_value_heads, input_layout, sparse_mode, scale):
        calls.append("fia")
        assert input_layout == "TND" and sparse_mode == 3 and atten_mask.shape == (2048, 2048)
        assert atten_mask.dtype == torch.int8 and block_table.dtype == torch.int32
        assert isinstance(actual_seq_lengths, list) and isinstance(actual_seq_lengths_kv, list)
        assert actual_seq_lengths[-1] == query.shape[0]  # cumulative query lengths
        assert key.dim() == 3 and key.shape[1] == block_size  # BnBsH
        kvn, d = num_key_value_heads, query.shape[2]
        kc, vc = key.view(key.shape[0], block_size, kvn, d), value.view(value.shape[0], block_size, kvn, d)
        out = torch.empty_like(query)
        start = 0
        for b, (end, n_kv) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
            q = query[start:end]
            k, v = gather(kc, block_table[b], n_kv), gather(vc, block_table[b], n_kv)
            q_pos = torch.arange(n_kv - q.shape[0], n_kv)  # bottom-right causal
            out[start:end] = _attend(q, k, v, q_pos, scale).to(out.dtype)
            start = end
        return out, None

    mod._npu_reshape_and_cache = reshape_and_cache
    mod._npu_paged_attention = paged_attention
    mod.npu_fused_infer_attention_score = fia
    return mod


@pytest.fixture
def npu_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", _fake_torch_npu(calls))
    return calls


def test_npu_attention_matches_portable_path(npu_calls):
    torch.manual_seed(0)
    dt, layers, nb, bs, hkv, h, d = torch.bfloat16, 2, 16, 128, 2, 4, 64
    ours = PagedAttention(layers, nb, bs, hkv, d, dt, torch.device("cpu"))
    npu = NpuPagedAttention(layers, nb, bs, hkv, d, dt, torch.device("cpu"))
    tables = [[3, 7], [1, 2, 9], [4]]
    # Step 1: three fresh prompts. Step 2: a decode, a chunk after a cached prefix, a decode.
    # Step 3: decodes only.
    steps = [([0, 0, 0], [5, 130, 40]), ([5, 130, 40], [1, 60, 1]), ([6, 190, 41], [1, 1, 1])]
    for starts, news in steps:
        ours.prepare(tables, starts, news)
        npu.prepare(tables, starts, news)
        t = sum(news)
        for layer in range(layers):
            q, k, v = torch.randn(t, h, d, dtype=dt), torch.randn(t, hkv, d, dtype=dt), torch.randn(t, hkv, d, dtype=dt)
            a = ours(layer, q, k, v)
            b = npu(layer, q, k, v)
            assert (a.float() - b.float()).abs().max() < 0.05, (starts, news, layer)
    assert npu_calls.count("fia") == 4 and npu_calls.count("paged_attention") == 2
    assert npu_calls.count("reshape_and_cache") == 6


def test_npu_attention_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="head_dim"):
        NpuPagedAttention(1, 4, 128, 2, 96, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        NpuPagedAttention(1, 4, 128, 2, 64, torch.float32, torch.device("cpu"))
