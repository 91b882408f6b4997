"""The pd_separate routing rules on the coordinator's real Registry and Router (no processes):
roles from each source with the reported one winning, a prefill/decode pair by load and by
prefix (the two sides' tables apart), the hybrid fallback, then a decode instance alone, then
none; the decode instance's KV endpoint (ipc on one host, round robin over its workers)."""
from __future__ import annotations

from coordinator import pd_pairing as pd
from coordinator.config import CoordinatorConfig
from coordinator.registry import Instance, Registry
from coordinator.router import RouteInfo, Router, route_info, token_keys


class _Metrics:
    pass


def fleet(*roles: str, mode: str = "pd_separate", algorithm: str = "load_balance"):
    import msgspec
    cfg = msgspec.convert({"digs_scheduler_config": {"deploy_mode": mode, "algorithm_type": algorithm}},
                          CoordinatorConfig)
    reg = Registry(3, 5.0, False, False, 100)
    for i, r in enumerate(roles):
        inst = reg.add(Instance(id=i, ip="127.0.0.1", business_port=2000 + i, mgmt_port=2000 + i, role_given=r))
        inst.polled_ok = inst.seen = True
        inst.total_slots, inst.avail_slots = 8, 8
        if r == "decode":
            inst.kv_endpoints = [f"ipc:///run/i{i}/w0-kv.ipc"]
    return reg, Router(cfg, reg, _Metrics())


def test_role_sources_and_precedence():
    assert [pd.parse_role(v) for v in ("prefill", "P", 80, "68", "decode", "flex", "hybrid", "none", 85, None,
                                       True, "x")] == \
        ["prefill", "prefill", "prefill", "decode", "decode", "flex", "flex", "", "", "", "", ""]
    assert pd.role_from_static({"label": 2}) == "prefill" and pd.role_from_static({"label": 3, "role": 85}) == "decode"
    assert pd.role_from_static({"role": 68, "label": 2}) == "decode"
    body = {"service": {"roleStatus": "RoleReady", "currentRole": "decode"},
            "pd": {"role": "decode", "kvEndpoints": ["tcp://10.0.0.2:1121", "ipc:///r/kv-0.sock", 3],
                   "kvCurvePublicKey": "k" * 40}}
    assert pd.role_from_status(body) == ("decode", ["tcp://10.0.0.2:1121", "ipc:///r/kv-0.sock"], "k" * 40)
    assert pd.role_from_status({"service": {"currentRole": "none"}}) == ("", [], "")
    inst = Instance(id=0, ip="h", business_port=1, mgmt_port=2, role_given="prefill")
    assert inst.role == "prefill"
    inst.role_reported = "decode"  # what the instance says wins (a role POSTed at run time)
    assert inst.role == "decode"
    assert Instance(id=1, ip="h", business_port=1, mgmt_port=2).role == "flex"


def test_pair_fallback_and_refusal():
    reg, router = fleet("prefill", "prefill", "decode", "flex")
    reg.instances[0].running = 5  # the busier prefill instance is passed over
    p, d, decision = router.pick_pd(RouteInfo(), set())
    assert (p.id, d.id, decision) == (1, 2, "load")
    p, d, decision = router.pick_pd(RouteInfo(), {2})  # the decode instance out: the hybrid one, whole
    assert p is None and d.id == 3 and decision == "hybrid_load"
    p, d, decision = router.pick_pd(RouteInfo(), {0, 1})  # no prefill: the hybrid one
    assert p is None and d.id == 3
    p, d, decision = router.pick_pd(RouteInfo(), {0, 1, 3})  # no prefill, no hybrid: the decode one alone
    assert p is None and d.id == 2 and decision == "decode_alone_load"
    # prefill alone: one of them serves the request whole (issue 52: degrade, never wait)
    p, d, decision = router.pick_pd(RouteInfo(), {2, 3})
    assert p is None and d.id == 1 and decision == "prefill_whole_load"
    assert router.pick_pd(RouteInfo(), {0, 1, 2, 3}) == (None, None, "none_ready")
    reg.instances[2].kv_endpoints = []  # a decode instance with no KV endpoint: no pair with it
    p, d, decision = router.pick_pd(RouteInfo(), set())
    assert p is None and d.id == 3
    # single_node ignores roles
    reg, router = fleet("prefill", "decode", mode="single_node")
    assert router.pick(RouteInfo(), {0})[0].id == 1 and router.pick(RouteInfo(), {1})[0].id == 0


def test_affinity_per_side():
    reg, router = fleet("prefill", "prefill", "decode", "decode", algorithm="cache_affinity")
    info = RouteInfo(keys=token_keys(list(range(64)), 16))
    p1, d1, dec1 = router.pick_pd(info, set())
    assert dec1 == "affinity_miss"
    # the others are now less loaded: the same prefix still goes to the same pair
    reg.instances[p1.id].running = reg.instances[d1.id].running = 3
    p2, d2, dec2 = router.pick_pd(info, set())
    assert (p2.id, d2.id, dec2) == (p1.id, d1.id, "affinity_hit")
    assert set(router.table.values()) == {p1.id} and set(router.table_d.values()) == {d1.id}


def test_kv_endpoint_choice():
    eps = ["tcp://10.0.0.2:1121", "tcp://10.0.0.2:1122", "ipc:///r/kv-0.sock", "ipc:///r/kv-1.sock"]
    assert [pd.pick_endpoint(eps, True, n) for n in range(3)] == [eps[2], eps[3], eps[2]]
    assert [pd.pick_endpoint(eps, False, n) for n in range(3)] == [eps[0], eps[1], eps[0]]
    assert pd.pick_endpoint(eps[2:], False, 0) == eps[2] and pd.pick_endpoint([], True, 0) == ""
    name, value = pd.handoff_header("prefill", "ab-1", eps[0], "K" * 40)
    assert name == b"x-mindie-pd"
    assert value == b'{"op":"prefill","transferId":"ab-1","kvEndpoint":"tcp://10.0.0.2:1121","kvCurvePublicKey":"' + \
        b"K" * 40 + b'"}'
    assert pd.handoff_header("decode", "ab-1", eps[2], "K")[1] == b'{"op":"decode","transferId":"ab-1","kvEndpoint":"ipc:///r/kv-0.sock"}'


def test_a_responses_conversation_is_keyed_as_a_chat():
    """OpenAI Responses' ``input`` (a string or items) gives cache-affinity keys, the next turn's
    starting with the first turn's, and the same as the chat route's for the same conversation."""
    first = route_info("/v1/responses", {"input": "hi"}, 16, 4.0).keys
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "more"}]
    later = route_info("/v1/responses", {"input": turns}, 16, 4.0).keys
    assert len(first) == 1 and len(later) == 3 and later[0] == first[0]
    assert route_info("/v1/chat/completions", {"messages": turns}, 16, 4.0).keys == later
    assert route_info("/v1/embeddings", {"input": turns}, 16, 4.0).keys == []  # not a conversation
