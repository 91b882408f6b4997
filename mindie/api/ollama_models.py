"""Ollama's model routes: ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``, ``GET /api/version``,
and ``GET``/``HEAD /`` (``Ollama is running``, what
Ollama's front ends probe; ``POST /`` stays TGI's, mindie/api/tgi.py: ``RootResource``).

The served model (and each LoRA adapter, as a model of its own) is described from its folder
(``ModelCard``): ``details.format`` "gguf" for a GGUF checkpoint's model view, else "safetensors";
``family`` the config's ``model_type``; ``parameter_size`` counted from config.json's shapes
(embeddings, attention, MLP or experts, norms; written as Ollama writes it, "134.52M");
``quantization_level`` the GGUF file's type (from its name, "Q4_1") or the config's dtype
("BF16"); ``size`` the weight files' bytes; ``digest`` a sha256 of the name, config and weight
sizes (stable while the checkpoint is); ``modified_at`` the config's mtime. ``/api/show`` adds the
chat template (Jinja, the template the server renders: Ollama's own are Go templates), a
modelfile naming the weights, and ``model_info`` with ``<family>.context_length`` (the
checkpoint's ``max_position_embeddings``) and the shapes; ``capabilities`` ``completion``,
``tools`` and, with a reasoning parser, ``thinking``. ``/api/ps`` lists the model as loaded for
good (``expires_at`` far ahead), with the served context length (``maxSeqLen``).
``/api/version`` answers ``OLLAMA_VERSION``, the Ollama release whose API this one follows.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Container

import falcon
import falcon.asgi
import msgspec

from mindie.api import ollama_schema as S
from mindie.api.ollama import check_model
from mindie.contract import families
from mindie.contract.http_error import ApiError
from mindie.pipeline import read_body
from mindie.text.chat_template import ChatTemplateError

OLLAMA_VERSION = "0.12.0"
NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model that is never unloaded


def _human(n: int) -> str:
    """A parameter count as Ollama writes it: 134.52M, 7.62B."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def parameter_count(cfg: dict) -> int:
    """Decoder parameters from config.json's shapes (dense or mixture of experts)."""
    h, v = int(cfg.get("hidden_size", 0)), int(cfg.get("vocab_size", 0))
    layers = int(cfg.get("num_hidden_layers", 0))
    heads = int(cfg.get("num_attention_heads", 1) or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or (h // heads if heads else 0))
    attn = h * heads * hd * 2 + h * kv * hd * 2
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if experts:
        inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0))
        shared = int(cfg.get("n_shared_experts") or 0) * inter + int(cfg.get("shared_expert_intermediate_size") or 0)
        mlp = 3 * h * inter * experts + 3 * h * shared + h * experts
    else:
        mlp = 3 * h * int(cfg.get("intermediate_size", 0))
    embed = v * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embed + layers * (attn + mlp + 2 * h) + h


class ModelCard:
    """What Ollama says of a model, read once from its folder."""

    def __init__(self, name: str, model_dir: str, max_seq_len: int):
        self.name = name
        self.dir = Path(model_dir)
        self.max_seq_len = max_seq_len
        cfg_path = self.dir / "config.json"
        self.config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        gguf = self.dir / "mindie_gguf.json"
        view = json.loads(gguf.read_text()) if gguf.is_file() else {}
        if view.get("gguf"):
            self.format, self.weights = "gguf", [Path(view["gguf"])]
            m = re.search(r"\.((?:I?Q\d\w*)|BF16|F16|F32)\.gguf$", view["gguf"], re.IGNORECASE)
            self.quantization = m.group(1).upper() if m else "unknown"
        else:
            self.format, self.weights = "safetensors", sorted(self.dir.glob("*.safetensors"))
            dtype = str(self.config.get("torch_dtype") or "unknown")
            self.quantization = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper())
        self.size = sum(p.stat().st_size for p in self.weights if p.is_file())
        self.family = str(self.config.get("model_type") or "unknown")
        self.parameters = parameter_count(self.config)
        mtime = cfg_path.stat().st_mtime if cfg_path.is_file() else 0.0
        self.modified_at = datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")
        h = hashlib.sha256(name.encode() + json.dumps(self.config, sort_keys=True).encode() + str(self.size).encode())
        self.digest = h.hexdigest()

    def details(self, parent: str = "") -> dict:
        return {"parent_model": parent, "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": _human(self.parameters), "quantization_level": self.quantization}

    def entry(self, name: str, parent: str = "") -> dict:
        """A model as ``/api/tags`` lists it."""
        return {"name": name, "model": name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details(parent)}

    def model_info(self) -> dict:
        c, fam = self.config, self.family
        info: dict[str, Any] = {"general.architecture": fam, "general.parameter_count": self.parameters,
                                "general.basename": self.name}
        for key, name in (("max_position_embeddings", "context_length"), ("hidden_size", "embedding_length"),
                          ("num_hidden_layers", "block_count"), ("intermediate_size", "feed_forward_length"),
                          ("num_attention_heads", "attention.head_count"),
                          ("num_key_value_heads", "attention.head_count_kv"), ("rope_theta", "rope.freq_base"),
                          ("rms_norm_eps", "attention.layer_norm_rms_epsilon"), ("vocab_size", "vocab_size")):
            if c.get(key) is not None:
                info[f"{fam}.{name}"] = c[key]
        return info


def _json(resp: falcon.asgi.Response, body: Any, status: int = 200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = msgspec.json.encode(body)


class OllamaModels:
    """The model routes of one front end (one Falcon responder per route: suffixes)."""

    def __init__(self, card: ModelCard, adapters: Any, template: str, thinking: bool, max_request_mb: int):
        """``adapters``: the LoRA adapters (mindie/lora_adapters.py: ``listing()``, ``in``)."""
        self.card = card
        self.adapters = adapters
        self.template = template
        self.thinking = thinking
        self.max_request_mb = max_request_mb

    def _names(self) -> list[tuple[str, str]]:
        """(name, parent) of every model served: the base model, then each adapter."""
        return [(self.card.name, "")] + [(n, self.card.name) for n in sorted(self.adapters.listing())]

    async def on_get_tags(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        _json(resp, {"models": [self.card.entry(n, p) for n, p in self._names()]})

    async def on_get_ps(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        models = []
        for n, p in self._names():
            e = self.card.entry(n, p)
            del e["modified_at"]
            models.append({**e, "expires_at": NEVER, "size_vram": 0, "context_length": self.card.max_seq_len})
        _json(resp, {"models": models})

    async def on_get_version(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        _json(resp, {"version": OLLAMA_VERSION})

    async def on_post_show(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        try:
            r: S.ShowRequest = S.decode(S.ShowRequest, await read_body(req, self.max_request_mb))
            model = r.model or r.name
            adapter = check_model(model, self.card.name, self.adapters)
        except ApiError as e:
            return _json(resp, *_error(e))
        c = self.card
        params = "\n".join(f"stop {json.dumps(s)}" for s in _stops(c.dir))
        modelfile = (f"# Modelfile generated by mindie-py\nFROM {c.weights[0] if c.weights else c.dir}\n"
                     + (f"ADAPTER {self.adapters.listing()[adapter]}\n" if adapter else "")
                     + f'TEMPLATE """{self.template}"""\n' + "".join(f"PARAMETER {p}\n" for p in params.splitlines()))
        caps = ["completion", "tools"] + (["thinking"] if self.thinking else [])
        _json(resp, {"modelfile": modelfile, "parameters": params, "template": self.template,
                     "details": c.details(c.name if adapter else ""), "model_info": c.model_info(),
                     "capabilities": caps, "modified_at": c.modified_at})



class RootResource:
    """``/``: TGI's compat route for POST (``tgi``: mindie/api/tgi.py TgiResource), Ollama's
    liveness text for GET and HEAD."""

    def __init__(self, tgi: Any):
        self.tgi = tgi

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.tgi.on_post_compat(req, resp)

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = "Ollama is running"

    async def on_head(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_TEXT


def _error(err: ApiError) -> tuple[dict, int]:
    status, body = families.error_answer(families.OLLAMA, err)
    return msgspec.json.decode(body), status


def _stops(model_dir: Path) -> list[str]:
    """The end-of-turn strings of the checkpoint (generation_config.json's eos ids, as text), for
    the modelfile's ``stop`` parameters; none when unknown."""
    try:
        gen = json.loads((model_dir / "generation_config.json").read_text())
        tok = json.loads((model_dir / "tokenizer_config.json").read_text()) if \
            (model_dir / "tokenizer_config.json").is_file() else {}
    except (OSError, ValueError):
        return []
    eos = gen.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    added = tok.get("added_tokens_decoder") or {}
    return [added[str(i)]["content"] for i in ids if isinstance(added.get(str(i)), dict)]


def ollama_model_routes(fe: Any, chat: Any, adapters: Container[str]) -> OllamaModels:
    """The model routes of a front end (mindie/server/frontend.py FrontEnd; ``chat``: its OpenAI chat
    codec, whose template and reasoning parser serve /api/chat)."""
    card = ModelCard(fe.model_name, os.fspath(fe.model_dir), fe.limits.max_seq_len)
    try:
        template = chat.template.source()
    except ChatTemplateError:  # several named templates, none the default: shown as none
        template = ""
    return OllamaModels(card, adapters, template, chat.reasoning is not None, fe.config.server.max_request_length)
