"""How mixture-of-experts checkpoints name their tensors (torch-free: workers/models/checkpoint.py
checks a checkpoint's headers against ``expected_tensors`` before any worker imports torch).
The layer itself is workers/models/moe.py, which re-exports these."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["DEEPSEEK_NAMES", "ExpertNames", "MIXTRAL_NAMES", "NAMES", "QWEN_NAMES", "expected_tensors"]


class ExpertNames(NamedTuple):
    """How a family names one MoE block's tensors under ``model.layers.{i}.``."""

    block: str  # "mlp" | "block_sparse_moe"
    w1: str  # gate projection of expert e: f"{block}.experts.{e}.{w1}.weight"
    w3: str  # up projection
    w2: str  # down projection
    shared: str = "shared_expert"  # f"{block}.{shared}.gate_proj/up_proj/down_proj.weight"
    shared_gate: str = "shared_expert_gate"  # f"{block}.{shared_gate}.weight" [1, H]


QWEN_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
DEEPSEEK_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", shared="shared_experts")


def expected_tensors(prefix: str, names: ExpertNames, hidden: int, num_experts: int, inter: int,
                     shared_inter: int = 0, shared_gate: bool = False) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of one MoE block's tensors (``prefix`` = "model.layers.{i}."), the
    router's ``gate.weight`` included (a router with more tensors, DeepSeek's correction bias,
    adds its own)."""
    b = f"{prefix}{names.block}."
    out: dict[str, tuple[int, ...]] = {f"{b}gate.weight": (num_experts, hidden)}
    for e in range(num_experts):
        out[f"{b}experts.{e}.{names.w1}.weight"] = (inter, hidden)
        out[f"{b}experts.{e}.{names.w3}.weight"] = (inter, hidden)
        out[f"{b}experts.{e}.{names.w2}.weight"] = (hidden, inter)
    if shared_inter:
        out[f"{b}{names.shared}.gate_proj.weight"] = (shared_inter, hidden)
        out[f"{b}{names.shared}.up_proj.weight"] = (shared_inter, hidden)
        out[f"{b}{names.shared}.down_proj.weight"] = (hidden, shared_inter)
        if shared_gate:
            out[f"{b}{names.shared_gate}.weight"] = (1, hidden)
    return out


NAMES = {"qwen": QWEN_NAMES, "mixtral": MIXTRAL_NAMES, "deepseek": DEEPSEEK_NAMES}  # MoeArgs.names -> ExpertNames
