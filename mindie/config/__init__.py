"""Server configuration: MindIE Server's ``config.json``, decoded and range-checked with msgspec.

The package's rooms, one job each:

- ``schema``: the Structs mirroring MindIE's key tree (snake_case fields, MindIE's camelCase and
  PascalCase keys at the JSON edge), their ranges, ``Loaded``;
- ``load``: ``load_config``: the file, the environment's overrides (``env_overrides``; launch.sh's
  flags arrive as variables too, named through ``provenance``), validation, checks, adjustments;
- ``unknown_keys``: the one unknown-key check with its "did you mean", used by the server, the
  coordinator's ms_coordinator.json and the fleet's user_config.json alike (``tree`` walks a
  file against any Struct tree);
- ``checks``: rules across fields and MindIE's adjustments; ``paths``: paths made absolute, the
  one default run directory (a server's or a fleet's) and its creation.

Only keys this project acts on are fields; other keys are accepted and reported in
``Loaded.ignored``, typos among them in ``Loaded.unknown``. ``load_config`` applies MindIE's
adjustments to the values themselves, so what a consumer reads is what runs. ``docs/config.md``
has the full table.

Front ends and the coordinator import this package, so it imports only the standard library,
msgspec and the project's dependency-free modules (never torch, nor anything heavy).

    loaded = load_config(path)   # ConfigError names the key, e.g.
                                 # "BackendConfig.ScheduleConfig.maxBatchSize: must be >= 1, got 0"
    loaded.config.backend.schedule.max_batch_size, loaded.notes, loaded.ignored
"""
from mindie.config.env_overrides import ENV_OVERRIDES
from mindie.config.load import load_config, read_json, translate
from mindie.config.paths import default_run_dir, ensure_run_dir
from mindie.config.provenance import ConfigError, setting_source
from mindie.config.schema import (
    DEFAULT_DRAIN_TIMEOUT_S, LOG_LEVELS, NGRAM_DEFAULT_TOKENS, SPEC_MAX_TOKENS, SUFFIX_DEFAULT_TOKENS,
    VALIDATED_NOT_APPLIED, BackendConfig, Config, CpuTuningConfig, HealthCheckConfig, Loaded, LogConfig,
    LoraModuleConfig, ModelConfig, ModelDeployConfig, ModelTypeOptions, ScheduleConfig, ServerConfig,
    ToolCallOptions, kv_tcp_host, python_log_level, speculation_plugin,
)
from mindie.config.tree import key_templates, keys_outside, lookup
from mindie.config.unknown_keys import did_you_mean, refuse_unknown

__all__ = [
    "Config", "ConfigError", "ServerConfig", "HealthCheckConfig", "BackendConfig", "ModelDeployConfig",
    "ModelConfig", "ModelTypeOptions", "ToolCallOptions", "LoraModuleConfig", "ScheduleConfig", "CpuTuningConfig",
    "LogConfig", "Loaded", "load_config", "default_run_dir", "ensure_run_dir", "python_log_level", "ENV_OVERRIDES",
    "DEFAULT_DRAIN_TIMEOUT_S", "LOG_LEVELS", "NGRAM_DEFAULT_TOKENS", "SPEC_MAX_TOKENS", "SUFFIX_DEFAULT_TOKENS",
    "VALIDATED_NOT_APPLIED", "kv_tcp_host", "setting_source", "speculation_plugin",
    # for the coordinator's ms_coordinator.json and the fleet's user_config.json
    "read_json", "translate", "keys_outside", "key_templates", "lookup", "did_you_mean", "refuse_unknown",
]
