"""The one unknown-key check: which keys of a file are typos, the closest known key for each
("did you mean"), and the message that names them. The server's config.json, the coordinator's
ms_coordinator.json and the fleet's user_config.json all use it.

A schema is given as its known keys, dotted (``key_templates``: list indices "[]", a mapping's own
keys ``<model_type>``). A key outside them is a typo unless its shape is known (MindIE's keys this
server accepts and does not use, ``MINDIE_UNUSED_KEYS``). The suggestion is the closest key of
its own section, or a closer one of another section unless its own section's is close already
(``ScheduleConfig.speculationGama`` -> ModelDeployConfig's ``speculationGamma``; a right name in
the wrong section -> where it belongs).

    unknown = did_you_mean(keys_outside(raw, Config), server_keys())  # [(key, suggestion or None)]
    key, message = refuse_unknown(unknown)
"""
from __future__ import annotations

import difflib
import os
import re
from typing import Iterable, Mapping, Optional, Sequence

from mindie.config.schema import Config
from mindie.config.tree import MAPPING_KEY, key_templates, path_steps

# MindIE Server's own keys that this server accepts and does not use (its shipped config.json
# 1.0 / 2.0 series, mindie-config-shape.md): reported at INFO. Any other key that is not this
# server's is taken for a typo: a WARNING with the closest known key, or a refusal in strict mode.
# List indices are written "[]".
MINDIE_UNUSED_KEYS = frozenset({
    "Version", "LogConfig.dynamicLogLevelValidHours", "LogConfig.dynamicLogLevelValidTime",
    "ServerConfig.kmcKsfMaster", "ServerConfig.kmcKsfStandby",
    "ServerConfig.interCommTLSEnabled", "ServerConfig.interCommTlsCaPath",
    "ServerConfig.interCommTlsCaFiles", "ServerConfig.interCommTlsCert", "ServerConfig.interCommPk",
    "ServerConfig.interCommPkPwd", "ServerConfig.interCommTlsCrlPath", "ServerConfig.interCommTlsCrlFiles",
    "ServerConfig.openAiSupport", "ServerConfig.distDPServerEnabled", "ServerConfig.tlsPkPwd",
    "ServerConfig.managementTlsPkPwd", "ServerConfig.metricsTlsPkPwd", "ServerConfig.maxLinkNumPerIp",
    "BackendConfig.backendName", "BackendConfig.modelInstanceNumber", "BackendConfig.tokenizerProcessNumber",
    "BackendConfig.multiNodesInferEnabled", "BackendConfig.multiNodesInferPort", "BackendConfig.interNodeTLSEnabled",
    "BackendConfig.interNodeTlsCaPath", "BackendConfig.interNodeTlsCaFiles", "BackendConfig.interNodeTlsCert",
    "BackendConfig.interNodeTlsPk", "BackendConfig.interNodeTlsPkPwd", "BackendConfig.interNodeTlsCrlPath",
    "BackendConfig.interNodeTlsCrlFiles", "BackendConfig.interNodeKmcKsfMaster", "BackendConfig.interNodeKmcKsfStandby",
    "BackendConfig.ModelDeployConfig.ModelConfig[].modelInstanceType",
    "BackendConfig.ModelDeployConfig.ModelConfig[].backendType",
    "BackendConfig.ModelDeployConfig.ModelConfig[].trustRemoteCode",
    "BackendConfig.ModelDeployConfig.ModelConfig[].async_scheduler_wait_time",
    "BackendConfig.ModelDeployConfig.ModelConfig[].kv_trans_timeout",
    "BackendConfig.ModelDeployConfig.ModelConfig[].kv_link_timeout",
    "BackendConfig.ModelDeployConfig.ModelConfig[].tp", "BackendConfig.ModelDeployConfig.ModelConfig[].dp",
    "BackendConfig.ModelDeployConfig.ModelConfig[].moe_tp", "BackendConfig.ModelDeployConfig.ModelConfig[].moe_ep",
    "BackendConfig.ModelDeployConfig.ModelConfig[].sp", "BackendConfig.ModelDeployConfig.ModelConfig[].cp",
    "BackendConfig.ScheduleConfig.templateType", "BackendConfig.ScheduleConfig.templateName",
    "BackendConfig.ScheduleConfig.policyType", "BackendConfig.ScheduleConfig.bufferResponseEnabled",
    "BackendConfig.ScheduleConfig.enableSplit", "BackendConfig.ScheduleConfig.splitType",
    "BackendConfig.ScheduleConfig.splitStartType", "BackendConfig.ScheduleConfig.splitChunkTokens",
    "BackendConfig.ScheduleConfig.splitStartBatchSize", "BackendConfig.ScheduleConfig.prefillPolicyType",
    "BackendConfig.ScheduleConfig.decodePolicyType", "BackendConfig.ScheduleConfig.maxFirstTokenWaitTime",
    "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds", "BackendConfig.ScheduleConfig.maxPreemptCount",
    "BackendConfig.ScheduleConfig.supportSelectBatch", "BackendConfig.ScheduleConfig.prefillExpectedTime",
    "BackendConfig.ScheduleConfig.decodeExpectedTime", "BackendConfig.ScheduleConfig.prefillTimeMsPerReq",
    "BackendConfig.ScheduleConfig.decodeTimeMsPerReq",
})

SIMILAR = 0.75  # the least similarity (difflib's ratio, case-insensitive) of a suggestion
OWN_SECTION_CLOSE = 0.8  # a suggestion of the key's own section this close wins over other sections'
SERVER_FILE = "MindIE config.json"  # whose keys the server's are: "not a MindIE config.json key nor ..."
_SERVER_KEYS: list[str] = []  # filled on first use (Config's tree and MINDIE_UNUSED_KEYS)


def server_keys() -> list[str]:
    """The keys of the server's config.json that this server or MindIE knows, as templates."""
    if not _SERVER_KEYS:
        _SERVER_KEYS.extend(dict.fromkeys(key_templates(Config) + sorted(MINDIE_UNUSED_KEYS)))
    return _SERVER_KEYS


def closest(name: str, names: Iterable[str]) -> tuple[float, Optional[str]]:
    """(similarity, the closest of ``names`` to ``name``), case-insensitive; (0, None) below SIMILAR."""
    best: tuple[float, Optional[str]] = (0.0, None)
    for n in names:
        ratio = difflib.SequenceMatcher(None, name.lower(), n.lower()).ratio()
        if ratio >= SIMILAR and ratio > best[0]:
            best = (ratio, n)
    return best


def _prefixes(known: Iterable[str]) -> set[str]:
    """Every known template and every section above one ("A.B[].c": "A", "A.B", "A.B[]", itself)."""
    out: set[str] = set()
    for t in known:
        out.add(t)
        out.update(t[:i] for i, ch in enumerate(t) if ch in ".[" and i)
    return out


def _template(key: str, prefixes: set[str]) -> str:
    """A dotted key's shape among the known ones: list indices "[]", a mapping's own keys MAPPING_KEY."""
    out = ""
    for name, _ in path_steps(key):
        if not name:
            out += "[]"
            continue
        here, mapped = (f"{out}.{name}", f"{out}.{MAPPING_KEY}") if out else (name, MAPPING_KEY)
        out = mapped if here not in prefixes and mapped in prefixes else here
    return out


def _fill_indices(template: str, key: str) -> str:
    """``template``'s "[]" as ``key``'s own index where the two share the list, else "[0]"."""
    key_template, indices = re.sub(r"\[\d+\]", "[]", key), re.findall(r"\[(\d+)\]", key)
    parts = template.split("[]")
    out = shape = parts[0]  # shape: the template so far, its indices "[]"
    for i, part in enumerate(parts[1:]):
        shape += "[]"
        shared = i < len(indices) and key_template.startswith(shape)
        out += f"[{indices[i] if shared else 0}]" + part
        shape += part
    return out


def did_you_mean(keys: Iterable[str], known: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    """Of ``keys`` (dotted keys a file holds outside its schema, ``tree.keys_outside``), those whose
    shape is not among the ``known`` templates, each with its closest known key or None."""
    prefixes, known_set = _prefixes(known), set(known)
    out = []
    for key in keys:
        template = _template(key, prefixes)
        if template in known_set:
            continue  # a known key that is no field (MindIE's own, unused here)
        parent, _, name = key.rpartition(".")
        section = template.rpartition(".")[0]
        ratio, close = closest(name, [t.rpartition(".")[2] for t in known if t.rpartition(".")[0] == section])
        suggestion = (f"{parent}.{close}" if parent else close) if close else None
        if MAPPING_KEY in template and ratio < OWN_SECTION_CLOSE:
            # MindIE's per-model-type options are many (DeepSeek's ep_level, ...): only a near miss of ours is a typo
            continue
        if ratio < OWN_SECTION_CLOSE:
            elsewhere = [t for t in known if t.rpartition(".")[0] != section]
            far_ratio, far = closest(name, [t.rpartition(".")[2] for t in elsewhere])
            if far and far_ratio > ratio:
                # the same leaf may sit in several sections: the one sharing most of the key's path
                paths = [t for t in elsewhere if t.rpartition(".")[2] == far]
                suggestion = _fill_indices(max(paths, key=lambda t: len(os.path.commonprefix([t, template]))), key)
        out.append((key, suggestion))
    return out


def refuse_unknown(unknown: Sequence[tuple[str, Optional[str]]], refused_by: Optional[str] = None,
                   file: str = SERVER_FILE, why_not: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], str]:
    """(key, message) of an error naming every key of ``unknown`` (``did_you_mean``'s list) and
    why: "(<refused_by> it/them)", or without ``refused_by`` "not a <file> key nor a project
    extension". ``why_not``: instead, per section (a key's dotted parent), why a key there is
    not known ("not a MindIE deploy_config key"), said after each key without a suggestion."""
    if len(unknown) == 1:
        key, close = unknown[0]
        if refused_by:
            why = f" ({refused_by} it)"
        elif close:
            why = ""
        else:
            why = f" ({why_not[key.rpartition('.')[0]]})" if why_not else f" (not a {file} key nor a project extension)"
        return key, "unknown key" + why + (f": did you mean {close}?" if close else "")
    if refused_by:
        why = f" ({refused_by} them)"
    else:
        why = "" if why_not else f" (not {file} keys nor project extensions)"
    return None, f"{len(unknown)} unknown keys{why}: " + "; ".join(
        key + (f" (did you mean {close}?)" if close else
               f" ({why_not[key.rpartition('.')[0]]})" if why_not and not refused_by else "")
        for key, close in unknown)
