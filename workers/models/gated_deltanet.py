"""The Gated DeltaNet layer of Qwen3-Next / Qwen3.5 over a flat batch, and the torch reference of
its gated delta rule (chunked and recurrent forms), as transformers 5 computes them.

Per token of a sequence (heads h; q, k l2-normalised, q scaled by 1/sqrt(d_k)):

    S_t = exp(g_t) * S_{t-1};   S_t += k_t (beta_t * (v_t - S_t^T k_t))^T;   o_t = S_t^T q_t

with ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; q, k, v come out of a
short causal depthwise convolution (``linear_conv_kernel_dim`` taps, SiLU) over the projected
``[q | k | v]`` channels. The output goes through a gated RMSNorm (``norm(o) * silu(z)``) and the
output projection. A sequence's state is its convolution's last ``K - 1`` inputs and ``S`` [heads,
d_k, d_v] (fp32): the state pool's slot (workers/attention/state_cache.py), carried from one step
to the next. Prompt chunks use the chunked (parallel) form, 64 tokens a chunk from the carried
state; decodes the recurrent form, one batched step over all decoding sequences. In
batch-invariant mode (``ScheduleConfig.batchInvariant``: the state pool's ``waves``) every token
takes the recurrent form, a prompt token by token from the carried state, and the convolution is
summed tap by tap in one order for every token (``_conv_rows``): the chunked form's sums follow the
chunk boundaries, which the scheduler sets by the other requests. The gates, the gated norm's
rsqrt and the SiLUs go through ``row_ops.elementwise``.

Projections: Qwen3.5 stores ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next
``in_proj_qkvz`` and ``in_proj_ba`` grouped by key head ([q k v z] per group), whose columns are
put in the [q | k | v | z] order by a fixed permutation after the product.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import row_ops
from .hybrid_config import HybridArgs
from .llama import Linear

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens in the chunked form. q, k [n, Hk, Dk]; v [n, Hv, Dv]; g, beta [n, Hv];
    state [Hv, Dk, Dv] fp32 (the initial state). Returns (o [n, Hv, Dv] in v's dtype, final state
    fp32). transformers' ``torch_chunk_gated_delta_rule`` for a batch of one, op for op."""
    dtype = v.dtype
    n, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    q, k, v, beta, g = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q * dk ** -0.5
    pad = (chunk_size - n % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(hv, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(hv, -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = state.to(new_v)
    out = torch.zeros_like(new_v)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[1]):
        v_new = new_v[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(hv, -1, dv)[:, :n]
    return out.transpose(0, 1).to(dtype).contiguous(), s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences in the recurrent form. q, k [B, Hk, Dk]; v [B, Hv, Dv];
    g, beta [B, Hv]; state [B, Hv, Dk, Dv] fp32. Returns (o [B, Hv, Dv] in v's dtype, new state).
    transformers' ``torch_recurrent_gated_delta_rule`` for one token, op for op."""
    dtype = v.dtype
    hk, dk = k.shape[1:]
    hv = v.shape[1]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    q, k, v, beta, g = (x.to(torch.float32) for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q / (dk ** 0.5)
    s = state.to(v) * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(dim=-2)
    return out.to(dtype), s


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output per value head, times silu(z) (transformers'
    Qwen3NextRMSNormGated; a plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * row_ops.elementwise(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * row_ops.elementwise(F.silu, gate.to(torch.float32))).to(dtype)


def _qkvz_order(hy: HybridArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Column permutations taking Qwen3-Next's grouped in_proj_qkvz / in_proj_ba outputs to
    [q | k | v | z] and [b | a]."""
    r = hy.num_v_heads // hy.num_k_heads
    dk, rv = hy.head_k_dim, r * hy.head_v_dim
    group = 2 * dk + 2 * rv
    parts = ((0, dk), (dk, dk), (2 * dk, rv), (2 * dk + rv, rv))
    qkvz = [torch.arange(gi * group + off, gi * group + off + n) for off, n in parts for gi in range(hy.num_k_heads)]
    ba = [torch.arange(gi * 2 * r + off, gi * 2 * r + off + r) for off in (0, r) for gi in range(hy.num_k_heads)]
    return torch.cat(qkvz), torch.cat(ba)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (module docstring). ``forward(x [T, H], states)``: ``states`` is
    the step's state pool view (workers/attention/state_cache.py ``StateCache`` after ``prepare``)."""

    def __init__(self, hy: HybridArgs, hidden: int, eps: float, layer: int, dtype: torch.dtype | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``layer``: this layer's index among the linear layers (its row of the state pool);
        ``hy``: this rank's heads and ``reduce`` the all-reduce of the row-parallel out_proj under
        tensor parallelism (workers/models/qwen3_next.py)."""
        super().__init__()
        self.hy, self.layer, self.reduce = hy, layer, reduce
        if hy.layout == "qkvz":
            self.in_proj_qkvz = Linear(hidden, hy.conv_dim + hy.value_dim, bias=False, dtype=dtype)
            self.in_proj_ba = Linear(hidden, 2 * hy.num_v_heads, bias=False, dtype=dtype)
            qkvz, ba = _qkvz_order(hy)
            self.register_buffer("qkvz_order", qkvz, persistent=False)
            self.register_buffer("ba_order", ba, persistent=False)
        else:
            self.in_proj_qkv = Linear(hidden, hy.conv_dim, bias=False, dtype=dtype)
            self.in_proj_z = Linear(hidden, hy.value_dim, bias=False, dtype=dtype)
            self.in_proj_b = Linear(hidden, hy.num_v_heads, bias=False, dtype=dtype)
            self.in_proj_a = Linear(hidden, hy.num_v_heads, bias=False, dtype=dtype)
        self.conv_weight = nn.Parameter(torch.empty(hy.conv_dim, 1, hy.conv_kernel, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hy.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hy.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(hy.head_v_dim, eps, dtype)
        self.out_proj = Linear(hy.value_dim, hidden, bias=False, dtype=dtype)
        # A device backend's recurrent step (workers/backends/cpu_deltanet.py: the C kernel), the
        # contract of recurrent_gated_delta_rule except that it updates ``state[slots]`` in place
        # and returns the output only; None = the torch reference.
        self.recurrent_kernel: Callable[..., torch.Tensor] | None = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed qkv [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv])."""
        hy = self.hy
        if hy.layout == "qkvz":
            qkvz = self.in_proj_qkvz(x).index_select(1, self.qkvz_order.to(x.device))
            b, a = self.in_proj_ba(x).index_select(1, self.ba_order.to(x.device)).split(hy.num_v_heads, dim=-1)
            mixed, z = qkvz.split([hy.conv_dim, hy.value_dim], dim=-1)
            return mixed, z, b, a
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, states) -> torch.Tensor:
        hy = self.hy
        t = x.shape[0]
        mixed, z, b, a = self.project(x)
        conv_state, rec_state = states.conv[self.layer], states.recurrent[self.layer]
        mixed = self._conv(mixed, conv_state, states)
        q, k, v = mixed.split([hy.key_dim, hy.key_dim, hy.value_dim], dim=-1)
        q = q.reshape(t, hy.num_k_heads, hy.head_k_dim)
        k = k.reshape(t, hy.num_k_heads, hy.head_k_dim)
        v = v.reshape(t, hy.num_v_heads, hy.head_v_dim)
        beta = row_ops.elementwise(torch.sigmoid, b)
        g = -self.A_log.float().exp() * row_ops.elementwise(F.softplus, a.float() + self.dt_bias)
        out = torch.empty_like(v)
        # batch-invariant mode, and speculative verify rows: every token one recurrent step, the
        # state after some kept in pool rows (a prefix checkpoint, a verify's scratch)
        for rows, slots, save_from, save_to in states.waves:
            self._recurrent(out, rows, slots, q, k, v, g, beta, rec_state)
            if save_from is not None:
                rec_state[save_to] = rec_state[save_from]
        if (rows := states.decode_rows) is not None:  # one batched recurrent step
            self._recurrent(out, rows, states.decode_slots, q, k, v, g, beta, rec_state)
        for row0, n, slot, keep in states.prefills:  # each prompt chunk (piece) from its carried state
            o, s = chunk_gated_delta_rule(q[row0:row0 + n], k[row0:row0 + n], v[row0:row0 + n], g[row0:row0 + n],
                                          beta[row0:row0 + n], rec_state[slot])
            out[row0:row0 + n] = o
            rec_state[slot] = s
            if keep >= 0:  # a prefix checkpoint at the block boundary this piece ends on
                rec_state[keep] = s
        o = self.norm(out.reshape(-1, hy.head_v_dim), z.reshape(-1, hy.head_v_dim))
        o = self.out_proj(o.reshape(t, hy.value_dim))
        return o if self.reduce is None else self.reduce(o)

    def _recurrent(self, out: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   rec_state: torch.Tensor) -> None:
        """One recurrent step of the sequences of ``rows`` (one token each) from their ``slots``'
        states, updated in place; ``out[rows]`` their outputs. The C kernel computes each (sequence,
        head) alone; the torch reference batches them, which in batch-invariant mode it may not (its
        norms' sums and exps would follow the batch), so there it takes one row a call."""
        if self.recurrent_kernel is not None:
            out[rows] = self.recurrent_kernel(q[rows], k[rows], v[rows], g[rows], beta[rows], rec_state, slots)
            return
        if row_ops.invariant() and rows.numel() > 1:
            for i in range(rows.numel()):
                self._recurrent(out, rows[i:i + 1], slots[i:i + 1], q, k, v, g, beta, rec_state)
            return
        o, s = recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], rec_state[slots])
        out[rows] = o
        rec_state[slots] = s

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, states) -> torch.Tensor:
        """The causal depthwise convolution + SiLU over each sequence's rows, its window starting
        with the carried last K - 1 inputs (zeros for a new sequence: transformers' zero padding);
        the state updated to the last K - 1 inputs."""
        if states.every_row:
            return self._conv_rows(mixed, conv_state, states)
        w = self.conv_weight
        out = torch.empty_like(mixed)
        keep = self.hy.conv_kernel - 1
        if (rows := states.decode_rows) is not None:
            slots = states.decode_slots
            window = torch.cat((conv_state[slots], mixed[rows].to(w.dtype)[:, :, None]), dim=-1)  # [B, C, K]
            out[rows] = F.silu(F.conv1d(window, w, groups=w.shape[0]))[:, :, 0].to(mixed.dtype)
            conv_state[slots] = window[:, :, -keep:]
        for row0, n, slot in states.chunks:
            window = torch.cat((conv_state[slot], mixed[row0:row0 + n].to(w.dtype).T), dim=-1)  # [C, K - 1 + n]
            y = F.conv1d(window[None], w, groups=w.shape[0])[0]  # [C, n]
            out[row0:row0 + n] = F.silu(y).T.to(mixed.dtype)
            conv_state[slot] = window[:, -keep:]
            for m, row in states.saves_by_slot.get(slot, ()):  # its state after m rows: their last K - 1 inputs
                conv_state[row] = window[:, m:m + keep]
        return out

    def _conv_rows(self, mixed: torch.Tensor, conv_state: torch.Tensor, states) -> torch.Tensor:
        """``_conv`` in batch-invariant mode: a token's output is its K taps' products summed in fp32
        in one order (tap 0 first), elementwise, so a prompt token's is computed as a decode's
        whatever the chunk around it (F.conv1d's order follows the shapes); SiLU through
        ``row_ops.elementwise``."""
        w = self.conv_weight
        taps = w[:, 0].float()  # [C, K]
        kk = self.hy.conv_kernel
        y = torch.empty(mixed.shape, dtype=torch.float32)
        for row0, n, slot in states.sequences:
            window = torch.cat((conv_state[slot], mixed[row0:row0 + n].to(w.dtype).T), dim=-1)  # [C, K - 1 + n]
            wf = window.float()
            acc = wf[:, 0:n] * taps[:, 0:1]
            for j in range(1, kk):
                acc = acc + wf[:, j:j + n] * taps[:, j:j + 1]
            y[row0:row0 + n] = acc.T
            conv_state[slot] = window[:, -(kk - 1):]
            for m, row in states.saves_by_slot.get(slot, ()):
                conv_state[row] = window[:, m:m + kk - 1]
        return row_ops.elementwise(F.silu, y.to(w.dtype)).to(mixed.dtype)
