"""Kirchenbauer et al. (2023) "green list" watermark, placed as TGI places it (tgi.md §3.5).

At each step the previous token id selects a pseudo-random "green" subset of the vocabulary
holding about ``gamma`` of it, and ``delta`` is added to the green logits (before the
repetition penalty and the warpers, for greedy and sampled rows alike). A detector that knows
the scheme counts green tokens in a text and reports a z-score; unwatermarked text scores
around 0, watermarked text grows like sqrt(length).

Green-list seeding differs from TGI on purpose. TGI seeds a torch Generator with
``hash_key * prev`` and takes ``randperm(vocab)[:int(vocab * gamma)]``, which depends on torch's
RNG and device and costs a permutation per row per step. Here membership is a keyed 32-bit hash
of the pair (prev, token): ``green <=> H(Ht(token) ^ Hp(prev)) < gamma * 2**32``. It is the same
on every device and in pure Python (so the detector needs no torch), costs a few integer passes
over the watermarked rows, and makes each token green with probability ``gamma`` independently,
which is exactly the null hypothesis of the z-test (the list size is Binomial(V, gamma) instead of
exactly ``int(V * gamma)``). The vocabulary size does not enter the hash.

Every hash step keeps values below 2**63 (32-bit values times 31-bit constants), so the torch
int64 code never overflows and matches the Python integer code bit for bit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # torch is imported lazily: the detector and its CLI run without it
    import torch

HASH_KEY = 15485863  # TGI's hash_key (a prime)
_M32 = 0xFFFFFFFF
# Two-round 32-bit integer hash (Wellons' "hash prospector" family); both multipliers < 2**31.
_C1 = 0x21F0AAAD
_C2 = 0x735A2D97
_TOKEN_SALT = 0x9E3779B9
_PREV_SALT = 0x85EBCA6B


@dataclass(frozen=True)
class WatermarkConfig:
    """Server-wide watermark settings (TGI: env WATERMARK_GAMMA / WATERMARK_DELTA)."""

    gamma: float = 0.5  # fraction of the vocabulary that is green
    delta: float = 2.0  # logit bias added to green tokens
    hash_key: int = HASH_KEY

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark gamma must be in (0, 1), got {self.gamma}")
        if not math.isfinite(self.delta):
            raise ValueError(f"watermark delta must be finite, got {self.delta}")

    @classmethod
    def from_env(cls) -> "WatermarkConfig":
        return cls(gamma=float(os.environ.get("WATERMARK_GAMMA", 0.5)),
                   delta=float(os.environ.get("WATERMARK_DELTA", 2.0)))

    @property
    def threshold(self) -> int:
        """A hash value below this is green."""
        return green_threshold(self.gamma)


def green_threshold(gamma: float) -> int:
    return min(1 << 32, max(0, int(gamma * (1 << 32))))


# ---------------------------------------------------------------------------------------------
# Pure-Python hash (detector) -- must stay bit-identical to the torch version below.
# ---------------------------------------------------------------------------------------------


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    x ^= x >> 15
    return x


def _token_hash(tok: int) -> int:
    return _mix32((tok + _TOKEN_SALT) & _M32)


def _prev_key(prev: int, hash_key: int = HASH_KEY) -> int:
    return _mix32((prev * hash_key + _PREV_SALT) & _M32)


def pair_hash(prev: int, tok: int, hash_key: int = HASH_KEY) -> int:
    """32-bit hash deciding whether ``tok`` is green after ``prev``."""
    return _mix32(_token_hash(tok) ^ _prev_key(prev, hash_key))


def is_green(prev: int, tok: int, gamma: float = 0.5, hash_key: int = HASH_KEY) -> bool:
    return pair_hash(prev, tok, hash_key) < green_threshold(gamma)


# ---------------------------------------------------------------------------------------------
# torch version (generation)
# ---------------------------------------------------------------------------------------------


def _mix32_(x: "torch.Tensor") -> "torch.Tensor":
    """In-place _mix32 on an int64 tensor of values in [0, 2**32)."""
    x ^= x >> 16
    x.mul_(_C1).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_C2).bitwise_and_(_M32)
    x ^= x >> 15
    return x


class WatermarkLogitsProcessor:
    """Adds ``delta`` to the green logits of the watermarked rows, vectorised over them."""

    def __init__(self, config: WatermarkConfig | None = None) -> None:
        self.config = config or WatermarkConfig()
        self._token_hashes: dict[tuple[int, str], "torch.Tensor"] = {}

    def token_hashes(self, vocab_size: int, device: "torch.device") -> "torch.Tensor":
        """_token_hash(v) for every v < vocab_size, cached (it never changes)."""
        import torch

        key = (vocab_size, str(device))
        t = self._token_hashes.get(key)
        if t is None:
            t = torch.arange(vocab_size, dtype=torch.int64, device=device).add_(_TOKEN_SALT)
            t = _mix32_(t.bitwise_and_(_M32))
            self._token_hashes[key] = t
        return t

    def green_mask(self, prev: "torch.Tensor", vocab_size: int) -> "torch.Tensor":
        """Bool[R, vocab_size]: the green list of each row given its previous token ids [R]."""
        import torch

        prev = prev.to(dtype=torch.int64)
        keys = _mix32_((prev * self.config.hash_key + _PREV_SALT).bitwise_and_(_M32))
        h = self.token_hashes(vocab_size, prev.device)[None, :] ^ keys[:, None]
        return _mix32_(h) < self.config.threshold

    def __call__(self, logits: "torch.Tensor", prev: "torch.Tensor") -> "torch.Tensor":
        """In place on ``logits`` [R, V] (rows to watermark), ``prev`` [R] previous token ids."""
        mask = self.green_mask(prev.to(logits.device), logits.shape[-1])
        logits.add_(mask.to(logits.dtype), alpha=self.config.delta)
        return logits


# ---------------------------------------------------------------------------------------------
# Detector
# ---------------------------------------------------------------------------------------------


def detect(token_ids: Sequence[int], vocab_size: int | None = None, gamma: float = 0.5,
           hash_key: int = HASH_KEY) -> tuple[float, int, int]:
    """Return ``(z_score, green_count, total)`` over the consecutive pairs of ``token_ids``.

    The first id only seeds the first green list, so ``total = len(token_ids) - 1``; pass the
    last prompt token in front of the generated ids to score every generated token.
    ``z = (green - gamma * total) / sqrt(total * gamma * (1 - gamma))``; 0.0 when total is 0.
    ``vocab_size``, when given, is only used to reject ids outside the vocabulary.
    """
    if not 0.0 < gamma < 1.0:
        raise ValueError(f"gamma must be in (0, 1), got {gamma}")
    ids = [int(t) for t in token_ids]
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    thr = green_threshold(gamma)
    green = sum(1 for prev, tok in zip(ids, ids[1:]) if pair_hash(prev, tok, hash_key) < thr)
    total = max(0, len(ids) - 1)
    if total == 0:
        return 0.0, 0, 0
    z = (green - gamma * total) / math.sqrt(total * gamma * (1.0 - gamma))
    return z, green, total


def _parse_ids(text: str) -> list[int]:
    data = json.loads(text)
    if isinstance(data, dict):  # accept {"token_ids": [...]} or a /infer reply's details
        data = data.get("token_ids", data.get("generated_token_ids"))
    if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        raise ValueError("token ids must be a JSON list of integers")
    return data


def main(argv: Iterable[str] | None = None) -> int:
    """``mindie-watermark-detect``: print the watermark z-score of a token-id sequence as JSON."""
    env = WatermarkConfig.from_env() if ("WATERMARK_GAMMA" in os.environ or "WATERMARK_DELTA" in os.environ) \
        else WatermarkConfig()
    ap = argparse.ArgumentParser(
        prog="mindie-watermark-detect",
        description="Detect the green-list watermark (Kirchenbauer et al.) in generated token ids. "
                    "Pass the ids as a JSON list (e.g. '[1, 2, 3]') or pipe them on stdin. Prefix the "
                    "last prompt token to score the first generated token too.")
    ap.add_argument("token_ids", nargs="?", help="JSON list of token ids (default: read stdin)")
    ap.add_argument("--vocab-size", type=int, default=None, help="reject ids outside [0, N)")
    ap.add_argument("--gamma", type=float, default=env.gamma,
                    help="green-list fraction used at generation (default %(default)s; env WATERMARK_GAMMA)")
    ap.add_argument("--delta", type=float, default=env.delta,
                    help="green logit bias used at generation; reported only, the z-score does not "
                         "depend on it (default %(default)s; env WATERMARK_DELTA)")
    ap.add_argument("--hash-key", type=int, default=HASH_KEY, help=argparse.SUPPRESS)
    ap.add_argument("--threshold", type=float, default=4.0,
                    help="z-score above which the text is reported as watermarked (default %(default)s)")
    args = ap.parse_args(None if argv is None else list(argv))
    try:
        ids = _parse_ids(args.token_ids if args.token_ids is not None else sys.stdin.read())
        z, green, total = detect(ids, args.vocab_size, args.gamma, args.hash_key)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        print(json.dumps({"error": str(exc)}), file=sys.stderr)
        return 2
    p_value = 0.5 * math.erfc(z / math.sqrt(2.0))  # one-sided
    print(json.dumps({"z_score": z, "p_value": p_value, "green": green, "total": total,
                      "gamma": args.gamma, "delta": args.delta, "watermarked": z > args.threshold}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
