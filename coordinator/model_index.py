"""Which instances serve which model, and where each is loaded: used by routing and by the
coordinator's own ``GET /v1/models`` and ``GET /api/tags``.

A server serves every ``ModelConfig`` entry under its ``modelName`` (and its LoRA adapters),
loading one on demand when a request names it (docs/design.md, "Several models"). The set of
names is fixed for a server's life, so the coordinator reads an instance's business-plane
``GET /v1/models`` (and Ollama's ``GET /api/tags``) once, when it admits it
(coordinator/registry.py), and again only when it is admitted anew after being away: no cost on
the per-interval poll. Which of them are *loaded* changes by the minute: the poll's
``/v2/status`` carries it (``models``, each model's state, from a server of several models; a
one-model server has no such field and its model is always loaded). ``loaded_names`` reads it;
``warm`` says whether an instance has a model loaded (or loading: it is on its way). Routing
(coordinator/router.py) sends a request for a model to the instances where it is warm when one of
them can take it, else to any that lists it, which loads it on demand.

A request's model name (``model_of``): the model named by the path (``/v2/models/{m}/...``,
``/v1/models/{m}``), else the JSON body's ``model`` (``name`` for Ollama's ``/api/show``). It
*scopes* routing (``ModelIndex.scope``) only when some instance lists it (Ollama's ``:latest``
tag dropped if needed); a request naming a model no instance lists goes to any instance, as one
naming none does, so its answer is that instance's own (the API's 404 in the API's shape and
words, or a placeholder name such as ``tgi`` accepted as the server accepts it).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable, Optional
from urllib.parse import unquote

import msgspec

_PATH_MODEL = re.compile(r"^/v[12]/models/([^/]+)")
# per instance and per minute: not a property of the model the fleet serves
_PER_INSTANCE = ("loaded", "status")
# the states of a model that is loaded or on its way (mindie/contract/model_wire.py)
WARM = frozenset({"loaded", "loading"})


def model_of(path: str, body: Any) -> str:
    """The model a request names ("" when none), as the server's model router reads it."""
    m = _PATH_MODEL.match(path)
    if m:
        return unquote(m.group(1))
    if not isinstance(body, dict):
        return ""
    name = body.get("name") if path == "/api/show" and "model" not in body else body.get("model")
    return name if isinstance(name, str) else ""


def listed(content: bytes, key: str = "data", name: str = "id") -> dict[str, dict]:
    """The models of a ``GET /v1/models`` answer (already checked to be one): id -> its item,
    less the fields that say what this instance has loaded now. ``key="models", name="name"``:
    those of Ollama's ``GET /api/tags``."""
    out: dict[str, dict] = {}
    data = msgspec.json.decode(content).get(key) or []
    for item in data:
        if isinstance(item, dict) and isinstance(item.get(name), str):
            out[item[name]] = {k: v for k, v in item.items() if k not in _PER_INSTANCE}
    return out


def loaded_names(models: Optional[dict]) -> Optional[frozenset]:
    """The models loaded (or loading) on an instance, from its ``/v2/status`` ``models`` (name ->
    a struct with ``state``); None when it has no such field: a one-model server, whose model is
    always loaded."""
    if models is None:
        return None
    return frozenset(name for name, st in models.items() if st.state in WARM)


class ModelIndex:
    """How many known instances list each model name (any state: a model whose instances are all
    away is still a model of the fleet, answered 503, not routed elsewhere for a 404)."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()

    def change(self, old: Iterable[str], new: Iterable[str]) -> None:
        self.count.subtract(list(old))  # names (a dict's keys), never a mapping's values as counts
        self.count.update(list(new))
        for k in [k for k, n in self.count.items() if n <= 0]:
            del self.count[k]

    def scope(self, name: str) -> str:
        """The model name routing is restricted to for a request naming ``name``: itself when
        an instance lists it (or lists it without Ollama's ``:latest``), else "" (any instance)."""
        if not name:
            return ""
        if name in self.count:
            return name
        bare = name.removesuffix(":latest")
        return bare if bare in self.count else ""


def aggregate_tags(instances: Iterable[Any]) -> dict:
    """Ollama's ``GET /api/tags`` of the fleet: each model the given instances list, once (the
    first instance's item, by id, as ``aggregate``)."""
    items: dict[str, dict] = {}
    for inst in sorted(instances, key=lambda i: i.id):
        for name, item in inst.tags.items():
            items.setdefault(name, item)
    return {"models": list(items.values())}


def merge_ps(answers: Iterable[Any]) -> dict:
    """Ollama's ``GET /api/ps`` of the fleet from its instances' own answers (None: none): each
    loaded model once, with the latest ``expires_at`` (the fleet holds it at least that long)."""
    items: dict[str, dict] = {}
    for answer in answers:
        models = answer.get("models") if isinstance(answer, dict) else None
        for item in models if isinstance(models, list) else []:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            known = items.get(item["name"])
            if known is None or str(item.get("expires_at", "")) > str(known.get("expires_at", "")):
                items[item["name"]] = item
    return {"models": list(items.values())}


def aggregate(instances: Iterable[Any]) -> dict:
    """``GET /v1/models`` of the fleet: each model the given instances list, once (the first
    instance's item), with ``instances``: how many of them serve it (a project extension, as
    MindIE Motor counts instances per model). In the order of the instances' ids, then each
    instance's own: the same list whichever instance was admitted first."""
    items: dict[str, dict] = {}
    counts: Counter[str] = Counter()
    for inst in sorted(instances, key=lambda i: i.id):
        for mid, item in inst.models.items():
            items.setdefault(mid, item)
            counts[mid] += 1
    return {"object": "list", "data": [{**item, "instances": counts[mid]} for mid, item in items.items()]}


def serves(inst: Any, scope: Optional[str]) -> bool:
    """Does ``inst`` serve the request's scoped model ("" or None: any instance does)?"""
    return not scope or scope in inst.models


def warm(inst: Any, scope: Optional[str]) -> bool:
    """Is the request's scoped model loaded (or loading) on ``inst``, as its last poll said (or
    as this coordinator's latest routing there implies)? Unscoped: yes."""
    return not scope or inst.loaded is None or scope in inst.loaded


def mark_warm(inst: Any, scope: Optional[str]) -> None:
    """``inst`` was just sent a request for ``scope``: it loads the model now if it had not, so
    the next request for it goes there too, not to a third instance, before the next poll says
    what is loaded (which then replaces this guess)."""
    if scope and inst.loaded is not None and scope not in inst.loaded:
        inst.loaded = inst.loaded | {scope}
