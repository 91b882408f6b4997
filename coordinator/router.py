"""Which instance a request goes to (``digs_scheduler_config.algorithm_type``).

``load_balance``: among the ready instances below ``request_limit.single_node_max_requests``
requests in flight, the one with the least load, where load =

    queued work / total slots  +  (1 - free KV blocks / total blocks, in 5 % steps) / 2

queued work = the requests this coordinator has in flight there now (exact) + the instance's
running + waiting at the last poll less this coordinator's share of them then (other clients' work). Figures missing (an instance that
does not report totals) count as empty. Ties go to the instance picked least recently, so idle
instances take turns. Not round-robin: a loaded instance is skipped while others have room.

``cache_affinity``: the request's prefix keys (``affinity_keys``) are looked up in a table of
prefix -> instance. For an OpenAI chat request the keys hash the conversation message by message
from the first non-system message on (the next turn of a conversation begins with the messages
of the earlier ones, so it finds the instance that served them and holds their KV cache; a
shared system prompt alone ties nothing); for any other request they hash its
leading prompt blocks (``affinityBlockTokens`` tokens, or that many times
``string_token_rate`` characters of text). The longest key found wins. That instance is taken
unless it is *busy*: not ready, at ``single_node_max_requests``, or below MindIE's resource
warning lines (free slots / total slots < ``slots_thresh``, or free blocks / total blocks <
``block_thresh``); then the request goes by load, as does a request no key matches. Every key
of the request is then recorded for the chosen instance. The table keeps at most ``cache_size``
thousand keys, least recently used dropped first; keys of an instance that leaves are dropped.

Several models (coordinator/model_index.py): a request naming a model that some instance lists
(``RouteInfo.scope``) is routed by either rule among the instances that list it only, and its
prefix keys are salted with the model's name (each model's KV cache is its own); a request naming
none, or a name no instance lists, is routed among all. Among those that list the model, the
instances where it is loaded (or loading, ``model_index.warm``) are preferred whenever one of
them has room: the others only when none has, and then the chosen one loads it on demand (and
counts as warm for the next request until a poll says otherwise), so requests for a model
gather where it is resident instead of making every instance load it in turn. An affine instance
where the model is not loaded while it is elsewhere is not taken (its KV cache of that model
left with the model): ``affinity_cold``, by load among the warm ones.

``deploy_mode: pd_separate`` (``pick_pd``): a prefill instance and a decode instance are chosen
for each request, each among the ready instances of its role by the rule above (the prefill
side's and the decode side's prefix tables are apart: both hold prefix caches); with no ready
prefill or no ready decode instance the request goes whole to a ``flex`` (hybrid) instance,
else to a ready decode instance (which computes a prompt itself), else whole to a ready prefill
instance (``X-Mindie-PD`` op ``whole``: MindIE's fallback to hybrid serving), else it is refused
503. So any ready instance can serve: readiness (any instance ready) tells the truth in PD too.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from mindie.contract.pd import DECODE, FLEX, PREFILL
from coordinator.model_index import mark_warm, model_of, serves, warm
from coordinator.registry import Instance, Registry

MAX_KEYS = 64  # prefix keys per request (the leading 64 blocks or messages)


@dataclass
class RouteInfo:
    """What routing needs of one request."""
    keys: list[bytes] = field(default_factory=list)  # prefix keys, shortest prefix first
    model: str = ""  # the model the request names ("" = none; coordinator/model_index.py)
    scope: str = ""  # the model routing is restricted to: ``model`` when an instance lists it, else ""


def _h(prev: bytes, part: bytes) -> bytes:
    return hashlib.blake2b(prev + part, digest_size=16).digest()


def chat_keys(messages: list) -> list[bytes]:
    """One key per message from the first user message on: the hash of the conversation up to
    and including it (a shared system prompt alone does not tie conversations to one instance)."""
    out, prev, talk = [], b"chat", False
    for m in messages[:MAX_KEYS]:
        if not isinstance(m, dict):
            break
        content = m.get("content")
        if not isinstance(content, str):
            import json
            content = json.dumps(content, sort_keys=True, ensure_ascii=False)
        prev = _h(prev, f"{m.get('role')}\x00{content}".encode("utf-8", "surrogatepass"))
        talk = talk or m.get("role") not in ("system", "developer")
        if talk:
            out.append(prev)
    return out


def token_keys(ids: list, block: int) -> list[bytes]:
    """One key per whole leading block of token ids."""
    out, prev = [], b"ids"
    for i in range(0, min(len(ids), block * MAX_KEYS) - block + 1, block):
        prev = _h(prev, repr(ids[i:i + block]).encode())
        out.append(prev)
    return out


def text_keys(text: str, chars: int) -> list[bytes]:
    """One key per whole leading block of ``chars`` characters."""
    out, prev = [], b"text"
    for i in range(0, min(len(text), chars * MAX_KEYS) - chars + 1, chars):
        prev = _h(prev, text[i:i + chars].encode("utf-8", "surrogatepass"))
        out.append(prev)
    return out


def route_info(path: str, body: Any, block_tokens: int, chars_per_token: float) -> RouteInfo:
    """The prefix keys of a parsed request body (any API family); none when it has no prompt."""
    info = RouteInfo(model=model_of(path, body))
    if not isinstance(body, dict):
        return info
    chars = max(1, int(block_tokens * chars_per_token))
    if isinstance(body.get("messages"), list):
        info.keys = chat_keys(body["messages"])
        return info
    if path == "/v1/responses" and isinstance(body.get("input"), (str, list)):
        # OpenAI Responses: ``input`` is the conversation (a string: one user message), keyed as a
        # chat's messages so its next turn, sent whole, finds the instance that holds its prefix.
        given = body["input"]
        info.keys = chat_keys([{"role": "user", "content": given}] if isinstance(given, str) else given)
        return info
    prompt = None
    for k in ("inputs", "prompt", "text_input", "input_id", "input_ids"):
        if k in body:
            prompt = body[k]
            break
    if prompt is None and isinstance(body.get("inputs"), list):
        prompt = body["inputs"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        # Triton /infer: [{"name": "input0", "data": [ids...]}]
        prompt = prompt[0].get("data")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        info.keys = text_keys(prompt, chars)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:block_tokens]):
        info.keys = token_keys(prompt, block_tokens)
    return info


class Router:
    def __init__(self, config: Any, registry: Registry, metrics: Any) -> None:
        d = config.digs_scheduler_config
        self.algorithm = d.algorithm_type
        self.slots_thresh = d.slots_thresh
        self.block_thresh = d.block_thresh
        self.capacity = d.cache_size * 1000
        self.per_node = config.request_limit.single_node_max_requests
        self.block_tokens = d.affinityBlockTokens
        self.chars_per_token = config.string_token_rate
        self.registry = registry
        self.metrics = metrics
        self.pd = d.deploy_mode == "pd_separate"
        self.table: OrderedDict[bytes, int] = OrderedDict()
        self.table_d: OrderedDict[bytes, int] = OrderedDict()  # the decode instances' prefixes (pd_separate)
        self.last_pick: dict[int, float] = {}
        registry.listeners.append(self._on_change)

    def _on_change(self, inst: Instance, ready: bool) -> None:
        if inst.id not in self.registry.instances:
            self.forget(inst.id)

    def forget(self, iid: int) -> None:
        self.forget_all({iid})

    def forget_all(self, iids: set[int]) -> None:
        """Drop the prefix keys of instances that left (one pass, however many left)."""
        if not iids:
            return
        for table in (self.table, self.table_d):
            for k in [k for k, v in table.items() if v in iids]:
                del table[k]
        for iid in iids:
            self.last_pick.pop(iid, None)

    def info(self, path: str, body: Any) -> RouteInfo:
        """The request's model scope, and its prefix keys under ``cache_affinity`` (salted with
        the scope: each model's prefixes are its own, as its KV cache is)."""
        if self.algorithm != "cache_affinity":
            info = RouteInfo(model=model_of(path, body))
        else:
            info = route_info(path, body, self.block_tokens, self.chars_per_token)
        info.scope = self.registry.models.scope(info.model)
        if info.scope:
            salt = _h(b"model", info.scope.encode("utf-8", "surrogatepass"))
            info.keys = [_h(salt, k) for k in info.keys]
        return info

    def serving_ready(self, info: RouteInfo) -> bool:
        """Is a ready instance serving the request's model (any ready instance when unscoped)?"""
        return any(serves(i, info.scope) for i in self.registry.ready())

    @staticmethod
    def load(i: Instance) -> float:
        # ours now (exact) + the others' at the last poll (its count less ours then)
        queued = i.inflight + max(0, i.running + i.waiting - i.inflight_at_poll)
        # KV use in 5 % steps: a few blocks held by the prefix cache do not outweigh queued work
        blocks = int(20 * (1.0 - i.avail_blocks / i.total_blocks)) / 20 if i.total_blocks else 0.0
        return queued / max(1, i.total_slots) + blocks / 2

    def has_room(self, i: Instance) -> bool:
        return i.inflight < self.per_node

    def busy(self, i: Instance) -> bool:
        if not i.ready() or not self.has_room(i):
            return True
        free = min(i.avail_slots, i.total_slots - i.inflight)  # the poll may not know our latest requests
        if i.total_slots and free / i.total_slots < self.slots_thresh:
            return True
        return bool(i.total_blocks) and i.avail_blocks / i.total_blocks < self.block_thresh

    def candidates(self, exclude: set[int], role: Optional[str] = None, scope: str = "") -> list[Instance]:
        """Ready instances with room, of ``role`` when given, serving the model ``scope`` when given."""
        return [i for i in self.registry.ready() if i.id not in exclude and self.has_room(i)
                and (not role or i.role == role) and serves(i, scope)]

    def pick_pd(self, info: RouteInfo, exclude: set[int]) -> tuple[Optional[Instance], Optional[Instance], str]:
        """pd_separate: (prefill, decode, decision) for a handoff; (None, flex, decision) for a
        hybrid instance when no prefill/decode pair is ready; (None, None, "none_ready")."""
        # a decode instance that reports no KV endpoint cannot receive blocks: not a pair's half
        deaf = {i.id for i in self.registry.ready() if i.role == DECODE and not i.kv_endpoints}
        if self.candidates(exclude, PREFILL, info.scope) and self.candidates(exclude | deaf, DECODE, info.scope):
            p, dp = self.pick(info, exclude, PREFILL)
            d, _ = self.pick(info, exclude | deaf, DECODE)
            return p, d, dp
        inst, decision = self.pick(info, exclude, FLEX)
        if inst is not None:
            return None, inst, f"hybrid_{decision}"
        # no hybrid either: a decode instance computes a prompt itself (it serves plain requests)
        inst, decision = self.pick(info, exclude, DECODE)
        if inst is not None:
            return None, inst, f"decode_alone_{decision}"
        # no decode instance: a prefill one serves the request whole when asked (the relay sends
        # the ``whole`` order), as MindIE falls back to hybrid serving; never a wait for a pair
        inst, decision = self.pick(info, exclude, PREFILL)
        return None, inst, decision if inst is None else f"prefill_whole_{decision}"

    def pick(self, info: RouteInfo, exclude: set[int], role: Optional[str] = None) -> tuple[Optional[Instance], str]:
        """(instance, decision) or (None, why): decision is one of load, affinity_hit,
        affinity_busy (the affine instance was busy: by load), affinity_cold (the model is not
        loaded there but is elsewhere: by load), affinity_miss (by load).
        ``role``: only instances of that role (pd_separate; in single_node every instance)."""
        if role is None and self.pd:
            role = FLEX
        table = self.table_d if role == DECODE else self.table
        cands = self.candidates(exclude, role, info.scope)
        if not cands:
            return None, "none_ready"
        hot = [i for i in cands if warm(i, info.scope)]
        if hot:  # the model is resident somewhere with room: there, not a load elsewhere
            cands = hot
        decision = "load"
        chosen: Optional[Instance] = None
        if self.algorithm == "cache_affinity":
            decision = "affinity_miss"
            for k in reversed(info.keys):
                iid = table.get(k)
                if iid is None:
                    continue
                inst = self.registry.instances.get(iid)
                if inst is None or iid in exclude or self.busy(inst) or (role and inst.role != role) \
                        or not serves(inst, info.scope):
                    decision = "affinity_busy"
                elif hot and all(h.id != iid for h in hot):
                    decision = "affinity_cold"
                else:
                    chosen, decision = inst, "affinity_hit"
                break
        if chosen is None:
            chosen = min(cands, key=lambda i: (round(self.load(i), 6), self.last_pick.get(i.id, 0.0), i.id))
        self.last_pick[chosen.id] = time.monotonic()
        mark_warm(chosen, info.scope)
        if info.keys:
            for k in info.keys:
                table[k] = chosen.id
                table.move_to_end(k)
            while len(table) > self.capacity:
                table.popitem(last=False)
        return chosen, decision
