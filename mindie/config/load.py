"""Loading the server's config.json: read the file, overlay the environment, validate with
msgspec (errors translated into ``<dotted key>: must be ...``, naming the variable that set a
value), check, adjust, make paths absolute (``load_config``). ``read_json`` and ``translate`` serve
the coordinator's ms_coordinator.json as well."""
import json
import os
import re
import typing
from typing import Any, Literal, Mapping, Optional

import msgspec

from mindie.config.checks import adjust, check
from mindie.config.env_overrides import apply_env, section
from mindie.config.paths import resolve_paths
from mindie.config.provenance import READING, ConfigError, env_for, setting_source
from mindie.config.schema import VALIDATED_NOT_APPLIED, Config, Loaded
from mindie.config.tree import keys_outside, lookup
from mindie.config.unknown_keys import did_you_mean, refuse_unknown, server_keys
from mindie.contract.spec import DEMO_MODEL_NAME


def read_json(path: str) -> Any:
    """A config file's JSON (UTF-8, a BOM allowed; NaN and Infinity refused), or ConfigError saying
    where it is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        # utf-8-sig: files saved by Windows editors start with a BOM.
        return json.loads(data.decode("utf-8-sig"), parse_constant=no_constants)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None


def load_config(path: Optional[str] = None, env: Mapping[str, str] = os.environ) -> Loaded:
    """Read, override from ``env``, validate, adjust. ``path`` None -> $MIES_CONFIG_JSON_PATH, else all defaults.

    An explicit ``path`` wins over MIES_CONFIG_JSON_PATH (a command-line flag beats the environment).
    """
    token = READING.set(env)
    try:
        return _load_config(path, env)
    finally:
        READING.reset(token)


def _load_config(path: Optional[str], env: Mapping[str, str]) -> Loaded:
    if path is None:
        path = env.get("MIES_CONFIG_JSON_PATH", "").strip() or None
    source = os.path.abspath(os.path.expanduser(path)) if path else None
    raw: Any = read_json(source) if source else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a JSON object, got {type(raw).__name__}", source=source)
    ignored = keys_outside(raw, Config)
    unknown = did_you_mean(ignored, server_keys())
    from_env = apply_env(raw, env)
    name_note = default_model_name(raw, env)
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as e:
        key, message = translate(e, raw, Config)
        raise ConfigError(message, key or "(top level)", env=env_for(key, from_env), source=source) from None
    check(config, from_env, source)
    if unknown and config.server.strict_config:
        # The keys are the file's: name it, and what turned strict mode on when not the file.
        var = from_env.get("ServerConfig.strictConfig")
        by = f"ServerConfig.strictConfig, set by {setting_source(var)}," if var else "ServerConfig.strictConfig"
        key, message = refuse_unknown(unknown, by + " refuses")
        e = ConfigError(message, key, source=source)
        e.unknown = unknown
        raise e
    notes = adjust(config) + ([name_note] if name_note else [])
    resolve_paths(config, os.path.dirname(os.path.abspath(source)) if source else os.getcwd(), env)
    for i, m in enumerate(config.backend.model_deploy.models):
        for model_type, opts in m.models.items():
            if opts.chat_template and not os.path.isfile(opts.chat_template):
                raise ConfigError(f"no such file: {opts.chat_template}", f"BackendConfig.ModelDeployConfig.ModelConfig[{i}]"
                                  f".models.{model_type}.chat_template", source=source)
    unapplied = [f"{k}: {why}" for k, why in VALIDATED_NOT_APPLIED.items() if lookup(raw, k, Config)[0]]
    return Loaded(config, source, ignored, notes, from_env, unapplied, unknown)


def default_model_name(raw: dict, env: Mapping[str, str]) -> Optional[str]:
    """A checkpoint configured without ``modelName`` is served under its directory's name, a
    GGUF file under its name without ``.gguf``; no checkpoint: the default model under its name
    (ModelConfig's default), the demo model (MINDIE_DEMO_MODEL, launch.sh --demo-model) as "demo".
    Returns a note when a checkpoint's name applies."""
    entries = (((raw.get("BackendConfig") or {}).get("ModelDeployConfig") or {}).get("ModelConfig")
               if isinstance(raw.get("BackendConfig"), dict) else None)
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        if env.get("MINDIE_DEMO_MODEL", "").strip() == "1":
            deploy = section(raw, "BackendConfig", "ModelDeployConfig")
            if deploy is not None and "ModelConfig" not in deploy:
                deploy["ModelConfig"] = [{"modelName": DEMO_MODEL_NAME}]
        return None
    m = entries[0]
    path = m.get("modelWeightPath")
    if "modelName" in m:
        return None
    if not isinstance(path, str) or not path.strip():
        if env.get("MINDIE_DEMO_MODEL", "").strip() == "1":
            m["modelName"] = DEMO_MODEL_NAME
        return None
    base = os.path.basename(os.path.normpath(path.strip()))
    base = base[:-5] if base.lower().endswith(".gguf") else base
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-.")[:256]
    m["modelName"] = name or "model"
    return (f"BackendConfig.ModelDeployConfig.ModelConfig[0].modelName not set: serving {path.strip()} "
            f"as {m['modelName']!r}")


def _literals(tp: Any) -> list[Any]:
    """The allowed values of a Literal (or a Union holding bool and Literals)."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    out: list[Any] = []
    for arg in typing.get_args(tp):
        out += [True, False] if arg is bool else _literals(arg)
    return out


# msgspec type names -> words for "must be <want>, got <got> <value>".
_GOT_WORDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
              "array": "a list", "object": "an object", "null": "null"}
_WANT_WORDS = {**_GOT_WORDS, "bool": "true or false", "bool | int": "true/false or -1/0/1",
               "int | null": "an integer or null", "bool | null": "true, false or null"}


def translate(err: msgspec.ValidationError, raw: Any, root: Any) -> tuple[str, str]:
    """msgspec's 'Expected `int` >= 1 - at `$.A.b`' -> ('A.b', 'must be >= 1, got 0'); ``raw``: the JSON
    converted to ``root`` (its values and declared types are looked up for the wording)."""
    text = str(err)
    m = re.fullmatch(r"(.*?) - at `\$(.*)`", text, re.S)
    what, path = (m.group(1), m.group(2).lstrip(".")) if m else (text, "")
    found, value, tp = lookup(raw, path, root) if path else (False, None, None)
    shown = f" {json.dumps(value)}" if found else ""
    if (t := re.fullmatch(r"Expected `([^`]+)`, got `([^`]+)`", what)):
        want = _WANT_WORDS.get(t.group(1), t.group(1))
        got = _GOT_WORDS.get(t.group(2), t.group(2))
        return path, f"must be {want}, got {got}{'' if shown == ' ' + got else shown}"  # not "got null null"
    got = f", got{shown}" if found else ""
    if what.startswith("Invalid enum value"):
        return path, f"must be one of {', '.join(json.dumps(v) for v in _literals(tp))}{got}"
    if (c := re.fullmatch(r"Expected `[^`]+` (.+)", what)):
        rule = c.group(1).replace("that's ", "").replace("matching regex", "match the pattern")
        rule = re.sub(r"^of length", "have length", rule)
        rule = rule if rule.startswith(("match", "have")) else "be " + rule
        return path, f"must {rule}{got}"
    return path, what[:1].lower() + what[1:]
