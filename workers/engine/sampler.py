"""Batched, seeded next-token sampler with TGI's semantics (reference/tgi.md §3).

Per step and row: the constraint's token mask (structured output: disallowed tokens -> -inf) ->
watermark bias -> repetition penalty -> presence / frequency penalties ->
(sampling rows only) temperature -> top_k -> top_p -> typical_p -> draw. Greedy rows take the
argmax after watermark and penalties. Rows whose request asks for log-probabilities
(``SamplingParams.logprobs >= 0``, through ``Sampler.sample_with_logprobs``) also get the
log-softmax of their logits after the penalties and the temperature (1 for greedy rows), before
top_k / top_p / typical_p: the chosen token's value and the k best (docs/sampling.md). A
constrained row's log-probabilities are those of its masked distribution (disallowed tokens have
none: the k best list only allowed ones), as vLLM returns processed ones.
Everything is vectorised over the batch; Python only loops over requests to read parameters.

Randomness is counter-based: the draw of a request at generation step ``s`` uses uniforms that
are a pure function of ``(seed, s)`` (splitmix64, computed exactly in Python). The token
therefore depends only on the request's own seed, parameters, history and logits: not on the
batch composition, the row position, preemption, the device or a process restart, and there is
no generator state to keep. The draw is inverse-CDF sampling (one uniform per row; TGI's
exponential race needs one random number per vocabulary entry, which on CPU costs more than the
whole rest of the sampler); in the dense route it is two-level (chunk, then token in the chunk,
each with its own uniform) so float32 keeps full precision.

Two routes for sampling rows, because top_p needs the probability-sorted vocabulary and a full
sort of [64, 32000] costs ~70 ms on CPU:

* candidate route (rows with top_k <= ``max_candidate_k`` or top_p, and no typical_p): filter
  and draw on the ``topk`` window of the row (k+1 entries for top_k rows; for top_p-only rows
  128, then 1024 entries), in a canonical order (probability desc, token id asc). A row whose
  kept set is not provably inside its window (a tie at the k-th value, or a nucleus reaching the
  window's edge) tries the next window, then the dense route.
* dense route: TGI's formulas over the whole vocabulary (full sorts for top_p / typical_p).

A row's window depends only on its own parameters, so which route serves it, and so its token,
never depends on the batch. Documented differences from TGI: a top_p tie at the nucleus edge is
broken by the lower token id (TGI: arbitrary sort order); the watermark green list is hash-based
(see watermark.py); the padding-0 quirk of TGI's penalty and watermark is not reproduced.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Protocol, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from mindie.contract.wire import SamplingParams
from workers.engine.watermark import WatermarkConfig, WatermarkLogitsProcessor

_NEG_INF = float("-inf")
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_U24 = 1.0 / (1 << 24)
MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs above this is clamped

# A row's log-probabilities: (the chosen token's, [(id, logprob)] of the k best, best first).
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# Token masks of some rows (structured output): (the rows, int32 bitmask [len(rows), words]: bit t
# of a row's words set when token t is allowed; llguidance's layout, workers/engine/constraints.py).
# Optionally a third element: the same masks as float32 [len(rows), words * 32], 0 where a token is
# allowed and -inf where not (MaskJob.additive, made beside the step; added on the CPU).
RowMasks = tuple  # (Sequence[int], np.ndarray) or (Sequence[int], np.ndarray, np.ndarray | None)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a 2-D fp32 tensor: the first maximum, a NaN counting as the maximum.
    On the CPU through numpy, whose vectorised argmax takes 2.5 µs for a 32000-entry row where
    torch's takes 18 (a decode step of a small model is about a millisecond); same results."""
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(-1)


def _splitmix64(x: int) -> int:
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_uniforms(seed: int, step: int) -> tuple[float, float]:
    """Two independent uniforms in [0, 1) (24-bit, exact in float32) for draw ``step`` of ``seed``:
    the ``step``-th output of a splitmix64 stream whose start is the mixed seed."""
    z = _splitmix64((_splitmix64(seed & _M64) + step * _GOLDEN) & _M64)
    return (z >> 40) * _U24, ((z >> 16) & 0xFFFFFF) * _U24


class Row(Protocol):
    """What the sampler reads of a request (``workers.engine.sequence.Sequence`` is one).

    ``params.do_sample`` must already be the effective flag (the front end decides it:
    ``mindie.text.validation.implicit_do_sample``); a temperature <= 0 also means greedy, and
    non-positive penalties are ignored. The draw index is ``num_output``, so a preempted and
    recomputed request draws the same tokens again."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def token_ids(self) -> np.ndarray: ...  # int64 [prompt + generated]: penalties and watermark

    @property
    def num_output(self) -> int: ...  # tokens generated so far (the tail of token_ids: presence/frequency)


class _Params(NamedTuple):
    """A row's parameters as the sampler applies them, derived at each call (well under a
    microsecond a row). Greedy rows get neutral warpers: argmax ignores them anyway."""

    seed: int
    sample: bool
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    penalty: float
    watermark: bool
    presence: float  # OpenAI presence_penalty (0 = off; a non-finite value is ignored)
    frequency: float  # OpenAI frequency_penalty
    logprobs: int  # -1: none, else how many alternatives (0 .. MAX_TOP_LOGPROBS)


def _finite(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else 0.0


def _effective(p: SamplingParams) -> _Params:
    t = float(p.temperature)
    sample = bool(p.do_sample) and t > 0.0
    rp = float(p.repetition_penalty)
    lp = int(p.logprobs)
    return _Params(int(p.seed) & _M64, sample, t if sample else 1.0, max(0, int(p.top_k)) if sample else 0,
                   float(p.top_p) if sample and p.top_p < 1.0 else 1.0,
                   float(p.typical_p) if sample and p.typical_p < 1.0 else 1.0,
                   rp if rp > 0.0 and math.isfinite(rp) else 1.0, bool(p.watermark),
                   _finite(p.presence_penalty), _finite(p.frequency_penalty),
                   min(lp, MAX_TOP_LOGPROBS) if lp >= 0 else -1)


class Sampler:
    """Batched sampler; one per worker: ``sampler(logits, rows) -> LongTensor[B]``.

    ``logits`` is [B, V] for the rows to sample, in the order of ``rows`` (see ``Row``); it may
    be modified in place (penalties). Call it once per engine step; the caller then appends
    ``tokens[i]`` to the history of ``rows[i]`` (the engine does: ``seq.tokens.append``).
    """

    def __init__(self, watermark: WatermarkConfig | None = None, *, candidates: int | Sequence[int] = (128, 1024),
                 max_candidate_k: int = 1024, chunk: int = 256) -> None:
        self.watermark = WatermarkLogitsProcessor(watermark)
        # Window sizes tried in turn for top_p-only rows before the dense route (sampled tokens
        # depend on this setting, not on the batch).
        self.candidates = tuple(max(2, c) for c in ((candidates,) if isinstance(candidates, int) else candidates))
        self.max_candidate_k = max_candidate_k
        self.chunk = chunk

    def __call__(self, logits: torch.Tensor, rows: Sequence[Row], masks: RowMasks | None = None) -> torch.Tensor:
        """``masks``: the token masks of the constrained rows (structured output), applied first."""
        return self._sample(logits, rows, False, masks)[0]

    def sample_with_logprobs(self, logits: torch.Tensor, rows: Sequence[Row], masks: RowMasks | None = None
                             ) -> tuple[torch.Tensor, list[Optional[TokenLogprobs]]]:
        """As ``__call__``, plus, for each row whose request asks (``params.logprobs >= 0``; None
        for the others), the chosen token's log-probability and the ``logprobs`` best
        alternatives, from the distribution the row was drawn from: the logits after watermark and
        penalties, divided by the temperature (sampling rows), log-softmaxed over the whole
        vocabulary (top_k / top_p / typical_p do not truncate it). Costs nothing for the rows
        that do not ask: the extra work is one log-softmax (and a topk) over the asking rows.
        A masked row's values are those of its masked distribution; its k best list only allowed ids."""
        return self._sample(logits, rows, True, masks)

    def _sample(self, logits: torch.Tensor, rows: Sequence[Row], want_logprobs: bool, masks: RowMasks | None = None
                ) -> tuple[torch.Tensor, list[Optional[TokenLogprobs]]]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if logits.dtype != torch.float32:  # bf16/fp16 model output: filter and draw in fp32
            logits = logits.float()
        if masks is not None and len(masks[0]):
            # First: every later stage (penalties, watermark, temperature, the filters) keeps a
            # disallowed token at -inf, and every route then draws among the allowed ones only.
            apply_token_masks(logits, list(masks[0]), masks[1], masks[2] if len(masks) > 2 else None)
        ps = [_effective(r.params) for r in rows]
        lp_rows = [i for i, p in enumerate(ps) if p.logprobs >= 0] if want_logprobs else []
        if not any(p.sample or p.penalty != 1.0 or p.watermark or p.presence or p.frequency for p in ps):
            # fast path: all greedy, nothing to adjust
            lsm = torch.log_softmax(_take(logits, lp_rows)[1], dim=-1) if lp_rows else None
            tokens = argmax_rows(logits)
        else:
            wm = [i for i, p in enumerate(ps) if p.watermark]
            if wm:
                self._apply_watermark(logits, wm, [rows[i].token_ids for i in wm])
            rp = [i for i, p in enumerate(ps) if p.penalty != 1.0]
            if rp:
                self._apply_repetition_penalty(logits, rp, [rows[i].token_ids for i in rp],
                                               [ps[i].penalty for i in rp])
            pf = [i for i, p in enumerate(ps) if p.presence or p.frequency]
            if pf:
                self._apply_presence_frequency(logits, pf, [_generated(rows[i]) for i in pf],
                                               [(ps[i].presence, ps[i].frequency) for i in pf])
            # The drawing routes may divide ``logits`` in place: take the log-softmax first.
            lsm = self._processed_logprobs(logits, lp_rows, ps) if lp_rows else None
            tokens = self._draw(logits, rows, ps)
        if lsm is None:
            return tokens, [None] * len(rows)
        return tokens, _gather_logprobs(lsm, tokens, lp_rows, ps, len(rows))

    @staticmethod
    def _processed_logprobs(logits: torch.Tensor, lp_rows: list[int], ps: list[_Params]) -> torch.Tensor:
        """[len(lp_rows), V] log-softmax of the (penalised) logits of ``lp_rows`` at each row's
        temperature (1.0 for greedy rows): a new tensor, never a view of ``logits``."""
        _, x = _take(logits, lp_rows)
        temps = [ps[i].temperature for i in lp_rows]
        if any(t != 1.0 for t in temps):
            x = x / torch.tensor(temps, dtype=torch.float32).to(x.device)[:, None]
        return torch.log_softmax(x, dim=-1)

    def _draw(self, logits: torch.Tensor, rows: Sequence[Row], ps: list[_Params]) -> torch.Tensor:
        """Greedy rows' argmax and sampling rows' draws on the adjusted logits."""
        B, V = logits.shape
        dev = logits.device
        tokens = torch.empty(B, dtype=torch.long, device=dev)
        greedy = [i for i, p in enumerate(ps) if not p.sample]
        if greedy:
            idx, x = _take(logits, greedy)
            _put(tokens, idx, argmax_rows(x))

        sampled = [i for i, p in enumerate(ps) if p.sample]
        if not sampled:
            return tokens
        u = torch.tensor([draw_uniforms(ps[i].seed, rows[i].num_output) for i in sampled],
                         dtype=torch.float32).to(dev)
        pos_of = {row: j for j, row in enumerate(sampled)}
        cand = [i for i in sampled if ps[i].typical_p >= 1.0
                and (0 < ps[i].top_k <= self.max_candidate_k or ps[i].top_p < 1.0)]
        cand_set = set(cand)
        dense = [i for i in sampled if i not in cand_set]
        for tier, window in enumerate(self.candidates):
            if tier:  # only top_p-only rows gain from a wider window; top_k rows with ties go dense
                dense += [i for i in cand if 0 < ps[i].top_k < V]
                cand = [i for i in cand if not 0 < ps[i].top_k < V]
            if not cand:
                break
            idx, x = _take(logits, cand)
            uc = u[[pos_of[i] for i in cand]]
            tok, ok = self._candidate_route(x, [ps[i] for i in cand], uc[:, 0:1], window)
            ok_l = ok.tolist()  # host sync: which rows need a wider window or the dense route
            good = [j for j, flag in enumerate(ok_l) if flag]
            if len(good) == len(cand):
                _put(tokens, idx, tok)
            elif good:
                _put(tokens, torch.tensor([cand[j] for j in good], device=dev), tok[torch.tensor(good, device=dev)])
            cand = [cand[j] for j, flag in enumerate(ok_l) if not flag]
        dense += cand
        if dense:
            dense.sort()
            idx, x = _take(logits, dense)
            ud = u[[pos_of[i] for i in dense]]
            _put(tokens, idx, self._dense_route(x, [ps[i] for i in dense], ud[:, 0:1], ud[:, 1:2]))
        return tokens

    # -- penalties (in place on logits) --------------------------------------------------------

    def _apply_watermark(self, logits: torch.Tensor, rows: list[int], ids: list[np.ndarray]) -> None:
        prev = torch.tensor([int(t[-1]) if len(t) else 0 for t in ids], dtype=torch.long).to(logits.device)
        idx, x = _take(logits, rows)
        self.watermark(x, prev)
        if idx is not None:
            logits.index_copy_(0, idx, x)

    @staticmethod
    def _apply_presence_frequency(logits: torch.Tensor, rows: list[int], ids: list[np.ndarray],
                                  pens: list[tuple[float, float]]) -> None:
        """OpenAI's penalties over the generated ids (vLLM's semantics): ``logits[id] -= presence
        * (count > 0) + frequency * count``, as one scatter_add of counts over a padded [R, L]
        id tensor (pads and ids outside the logits land in an extra column that is dropped)."""
        dev, V = logits.device, logits.shape[1]
        t = pad_sequence([torch.from_numpy(a) for a in ids], batch_first=True, padding_value=V).to(dev)
        if t.shape[1] == 0:
            return
        t = torch.where((t >= 0) & (t < V), t, V)
        counts = torch.zeros(len(rows), V + 1, dtype=torch.float32, device=dev)
        counts.scatter_add_(1, t, torch.ones(t.shape, dtype=torch.float32, device=dev))
        counts = counts[:, :V]
        pf = torch.tensor(pens, dtype=torch.float32).to(dev)
        idx, x = _take(logits, rows)
        x -= pf[:, 0:1] * (counts > 0) + pf[:, 1:2] * counts
        if idx is not None:
            logits.index_copy_(0, idx, x)

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, rows: list[int], ids: list[np.ndarray],
                                  penalties: list[float]) -> None:
        """CTRL penalty over the distinct ids of prompt + generated, as one gather/scatter over a
        padded [R, L] id tensor (duplicates write identical values, so they are harmless)."""
        dev, V = logits.device, logits.shape[1]
        t = pad_sequence([torch.from_numpy(a) for a in ids], batch_first=True, padding_value=-1).to(dev)
        if t.shape[1] == 0:
            return
        # Pads and ids outside the logits (tokenizer vocab > lm_head) become a real id of the row,
        # so they neither crash the gather nor penalise a token that never occurred.
        valid = (t >= 0) & (t < V)
        first = t.gather(1, valid.to(torch.uint8).argmax(1, keepdim=True)).clamp_(0, V - 1)
        t = torch.where(valid, t, first)
        pen = torch.tensor(penalties, dtype=torch.float32).to(dev)[:, None]
        pen = torch.where(valid.any(1, keepdim=True), pen, torch.ones_like(pen))
        idx, x = _take(logits, rows)
        s = x.gather(1, t)
        x.scatter_(1, t, torch.where(s < 0, s * pen, s / pen))
        if idx is not None:
            logits.index_copy_(0, idx, x)

    # -- candidate route -----------------------------------------------------------------------

    @staticmethod
    def _candidate_route(x: torch.Tensor, st: list[_Params], u: torch.Tensor, window: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Filter and draw inside each row's topk window (k + 1 for top_k rows, ``window`` for
        top_p-only rows). Returns the tokens and ok (rows whose result is exact; the others
        need a wider window or the dense route)."""
        R, V = x.shape
        dev = x.device
        ks = [s.top_k if s.top_k < V else 0 for s in st]  # top_k >= V filters nothing
        win = [k + 1 if k else min(window, V) for k in ks]
        K = max(win)
        f = torch.tensor([[s.temperature, s.top_p] for s in st], dtype=torch.float32).to(dev)
        temp, top_p = f[:, 0:1], f[:, 1:2]
        iw = torch.tensor([[k, w] for k, w in zip(ks, win)], dtype=torch.long).to(dev)
        kt, wt = iw[:, 0:1], iw[:, 1:2]

        vals, idx = torch.topk(x, K, dim=-1)
        vals = vals / temp  # the same elementwise op as the dense route's x / T
        # Canonical order (value desc, id asc): topk's order among ties may depend on K.
        idx, perm = idx.sort(dim=-1)
        vals = vals.gather(1, perm)
        vals, perm = vals.sort(dim=-1, descending=True, stable=True)
        idx = idx.gather(1, perm)

        pos = torch.arange(K, device=dev)[None, :]
        has_k = kt > 0
        limit = torch.where(has_k, kt, wt)  # positions this row may keep
        w = (vals - vals[:, :1]).exp().masked_fill_(pos >= limit, 0.0)
        c = w.cumsum(-1)
        # Mass top_p is measured against: the k survivors, or the whole (tempered) row.
        z = c.gather(1, limit - 1)
        p_only = [j for j, k in enumerate(ks) if not k]
        if p_only:
            pj, xs = _take(x, p_only)
            tj = temp if pj is None else temp[pj]
            if any(st[j].temperature != 1.0 for j in p_only):
                xs = xs / tj
            lse = torch.logsumexp(xs, dim=-1, keepdim=True)
            if pj is None:
                z = (lse - vals[:, :1]).exp()
            else:
                z[pj] = (lse - vals[pj, :1]).exp()
        keep = (((c - w) < top_p * z) | (top_p >= 1.0) | (pos == 0)) & (pos < limit)  # a prefix
        m = keep.sum(-1, keepdim=True)
        # Exact only if the kept set cannot change with a wider window:
        kth = vals.gather(1, (kt - 1).clamp(min=0))
        after_k = vals.gather(1, kt.clamp(max=K - 1))
        ok_k = (kth > after_k) | (kth == _NEG_INF)
        ok_p = (wt >= V) | (vals.gather(1, m - 1) > vals.gather(1, wt - 1))
        ok = torch.where(has_k, ok_k, ok_p)[:, 0]

        w = w * keep
        total = c.gather(1, m - 1)
        j = (c <= u * total).sum(-1, keepdim=True)
        j = torch.minimum(j, (w > 0).sum(-1, keepdim=True) - 1).clamp_(min=0)  # never a zero-mass token
        return idx.gather(1, j)[:, 0], ok

    # -- dense route ---------------------------------------------------------------------------

    def _dense_route(self, x: torch.Tensor, st: list[_Params], u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
        """TGI's warpers over the whole vocabulary, then the two-level draw."""
        R, V = x.shape
        dev = x.device
        f = torch.tensor([[s.temperature, s.top_p, s.typical_p] for s in st], dtype=torch.float32).to(dev)
        if any(s.temperature != 1.0 for s in st):
            x = x.div_(f[:, 0:1])  # in place: x is a copy or the caller's logits (documented)
        ks = [s.top_k if s.top_k < V else 0 for s in st]
        if any(ks):
            kt = torch.tensor(ks, dtype=torch.long).to(dev)[:, None]
            kth = torch.topk(x, max(ks), dim=-1).values.gather(1, (kt - 1).clamp(min=0))
            kth = kth.masked_fill_(kt == 0, _NEG_INF)
            x = x.masked_fill_(x < kth, _NEG_INF)  # ties with the k-th value survive
        for col, warp in ((1, _top_p_), (2, _typical_)):
            rows = [j for j, s in enumerate(st) if (s.top_p if col == 1 else s.typical_p) < 1.0]
            if rows:
                idx, xs = _take(x, rows)
                warp(xs, f[rows, col:col + 1])
                if idx is not None:
                    x.index_copy_(0, idx, xs)
        return self._draw_two_level(torch.softmax(x, dim=-1), u1, u2)

    def _draw_two_level(self, probs: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF draw: pick a chunk of ``chunk`` ids by its mass with u1, then an id inside
        it with u2. Exact in distribution, and no float32 cumsum over the whole vocabulary."""
        R, V = probs.shape
        C = min(self.chunk, V)
        nf = V // C
        sums = [probs[:, : nf * C].reshape(R, nf, C).sum(-1)]
        if V % C:
            sums.append(probs[:, nf * C:].sum(-1, keepdim=True))
        S = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]
        cs = S.cumsum(-1)
        j = (cs <= u1 * cs[:, -1:]).sum(-1, keepdim=True)
        j = torch.minimum(j, _last_nonzero(S))
        cols = j * C + torch.arange(C, device=probs.device)[None, :]
        wc = probs.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0.0)
        cc = wc.cumsum(-1)
        i = (cc <= u2 * cc[:, -1:]).sum(-1, keepdim=True)
        i = torch.minimum(i, _last_nonzero(wc))
        return (j * C + i)[:, 0]


def _top_p_(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """Nucleus filter in place: keep the smallest most-likely prefix whose mass reaches top_p
    (the token crossing the line included, the most likely token always). Equivalent to TGI's
    ascending form ``cumsum <= 1 - top_p -> remove``; stable sort breaks ties by id."""
    sv, si = x.sort(dim=-1, descending=True, stable=True)
    w = (sv - sv[:, :1]).exp()
    c = w.cumsum(-1)
    remove = (c - w) >= top_p * c[:, -1:]
    remove[:, 0] = False
    x.masked_fill_(remove.scatter(1, si, remove), _NEG_INF)


def _typical_(x: torch.Tensor, mass: torch.Tensor) -> None:
    """Typical filter in place, TGI's / transformers' formula (Meister et al.)."""
    lp = torch.log_softmax(x, dim=-1)
    ent = -(lp * lp.exp()).nansum(-1, keepdim=True)
    shifted = (-lp - ent).abs()
    ss, si = shifted.sort(dim=-1, stable=True)
    cum = x.gather(1, si).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=1, keepdim=True).clamp_(max=x.shape[1] - 1)
    x.masked_fill_(shifted > ss.gather(1, last), _NEG_INF)


def _generated(row: Row) -> np.ndarray:
    """The ids ``row`` generated so far (the tail of its history)."""
    ids = row.token_ids
    n = row.num_output
    return ids[len(ids) - n:] if n > 0 else ids[:0]


def _gather_logprobs(lsm: torch.Tensor, tokens: torch.Tensor, lp_rows: list[int], ps: list[_Params],
                     batch: int) -> list[Optional[TokenLogprobs]]:
    """Per row of the batch: None, or (the chosen token's log-probability, the k best), with one
    host transfer for all asking rows."""
    dev = lsm.device
    chosen = lsm.gather(1, tokens.index_select(0, torch.tensor(lp_rows, dtype=torch.long, device=dev))[:, None])
    kmax = max(ps[i].logprobs for i in lp_rows)
    chosen_l = chosen[:, 0].tolist()
    if kmax > 0:
        tv, ti = torch.topk(lsm, min(kmax, lsm.shape[1]), dim=-1)
        tv_l, ti_l = tv.tolist(), ti.tolist()
    out: list[Optional[TokenLogprobs]] = [None] * batch
    for j, i in enumerate(lp_rows):
        k = ps[i].logprobs
        # A masked row's disallowed ids (-inf) are no alternatives: fewer than k may remain.
        out[i] = (chosen_l[j], [(t, v) for t, v in zip(ti_l[j][:k], tv_l[j][:k]) if v != _NEG_INF] if k > 0 else [])
    return out


def unpack_token_masks(bits: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """bool [R, vocab] on ``device``: True where a token mask's bit is set (ids past the mask's width,
    a model head wider than its tokenizer, are never allowed)."""
    R, words = bits.shape
    if device.type == "cpu":
        allowed = torch.from_numpy(np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1,
                                                 bitorder="little")).to(torch.bool)
    else:  # move the words (4 bytes per 32 ids) and unpack there
        b = torch.from_numpy(np.ascontiguousarray(bits)).to(device)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((b[:, :, None] >> shifts) & 1).reshape(R, words * 32).to(torch.bool)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(R, vocab - allowed.shape[1])], dim=1)


def apply_token_masks(logits: torch.Tensor, rows: list[int], bits: np.ndarray,
                      additive: np.ndarray | None = None) -> None:
    """Disallowed tokens of ``rows`` to -inf, in place on fp32 ``logits``; ``additive``: the same
    masks as 0 / -inf rows, added on the CPU (x + 0 is x, x + -inf is -inf: the same logits)."""
    idx, x = _take(logits, rows)
    if additive is not None and logits.device.type == "cpu":
        n = min(x.shape[1], additive.shape[1])
        x[:, :n].add_(torch.from_numpy(additive[:, :n]))
        if n < x.shape[1]:  # a head wider than the tokenizer: never allowed
            x[:, n:] = _NEG_INF
    else:
        x.masked_fill_(~unpack_token_masks(bits, logits.shape[1], logits.device), _NEG_INF)
    if idx is not None:
        logits.index_copy_(0, idx, x)


def _last_nonzero(w: torch.Tensor) -> torch.Tensor:
    """[R, 1] index of the last positive entry of each row (0 if none)."""
    n = w.shape[1]
    return (n - 1 - (w > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)).clamp_(min=0)


def _take(t: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(index, rows of t): the tensor itself when ``rows`` is every row in order, else a copy."""
    if len(rows) == t.shape[0] and all(r == i for i, r in enumerate(rows)):
        return None, t
    idx = torch.tensor(rows, dtype=torch.long, device=t.device)
    return idx, t.index_select(0, idx)


def _put(out: torch.Tensor, idx: torch.Tensor | None, val: torch.Tensor) -> None:
    if idx is None:
        out.copy_(val)
    else:
        out.index_copy_(0, idx, val)
