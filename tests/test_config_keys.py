"""Every key of docs/config.md, with the tests that show its effect (or its refusal).

``KEY_TESTS`` maps each documented key (dotted, as in error messages; ``ModelConfig[]`` for the
list items) to the pytest node ids that show what the key does: the launch plan it produces
(``mindie.topology.build_deployment``), the scheduler, sampler or backend that reads it, the
front end's limits, or the running server. ``test_registry_*`` parse docs/config.md and keep the
registry honest: every documented key has an entry, no entry names an undocumented key, and
every node id names a test function that exists. Keys the docs mark "no effect" must map to
``test_unapplied_keys_are_logged`` (the launcher says so at start).

The effect tests missing elsewhere are here. The ones that need the real server share one start
(``server``, at the end of the file): fullTextEnabled, tokenTimeout, ipAddress, maxIterTimes,
maxSeqLen, maxInputTokenLen, truncation, modelName/modelWeightPath from the file, and what the
worker logs for cacheBlockSize, cpuMemSize, cpuThreadsPerWorker and overlapSteps.
"""
from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import msgspec
import numpy as np
import pytest

from mindie.config import Config, ConfigError, Loaded, ensure_run_dir, load_config
from mindie.contract.spec import EngineConfig, WorkerSpec
from mindie.contract.wire import SamplingParams, Submit
from mindie.server.listeners import plan_listeners
from mindie.topology import build_deployment
from tests.harness import Server, free_port, short_run_dir, write_config

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"
THIS = "tests/test_config_keys.py"
UNAPPLIED = f"{THIS}::test_unapplied_keys_are_logged"


def _here(*names: str) -> list[str]:
    return [f"{THIS}::{n}" for n in names]


# -------------------------------------------------------------------------------------------------
# The registry: documented key -> tests showing its effect or its refusal.
# -------------------------------------------------------------------------------------------------

_E2E = "tests/test_server_e2e.py"
_TLS = "tests/test_tls.py"
_CURVE = "tests/test_worker_curve.py"
_CFG = "tests/test_config.py"
_LORA = "tests/test_lora.py"
_ES = [f"tests/test_engine_settings.py::{n}" for n in ("test_each_key_reaches_the_plan_from_the_file_and_from_its_variable",
                                                         "test_the_worker_modules_run_with_the_plans_values")]

# The same tests cover a plane's six TLS keys: the files each plane is built from, a handshake per
# plane in-process, and the real server on three planes.
_PLANE_TLS = _here("test_tls_keys_of_each_plane") + [f"{_TLS}::test_https_and_mutual_tls_on_three_planes"]

KEY_TESTS: dict[str, list[str]] = {
    # -- top level
    "Version": [UNAPPLIED],
    "EnableDynamicAdjustTimeoutConfig": _here("test_dynamic_adjust_timeout_reaches_the_front_end_deadlines") + [
        f"{_CFG}::test_dynamic_timeout_sets_timeouts_to_their_maximum"],
    # -- ServerConfig
    "ServerConfig.ipAddress": _here("test_listener_addresses", "test_e2e_listens_on_ip_address_port_and_run_dir"),
    "ServerConfig.managementIpAddress": _here("test_listener_addresses") + [
        f"{_TLS}::test_https_and_mutual_tls_on_three_planes"],
    "ServerConfig.port": _here("test_e2e_listens_on_ip_address_port_and_run_dir") + [
        f"{_TLS}::test_planes_merge_when_ports_are_equal", f"{_TLS}::test_https_and_mutual_tls_on_three_planes"],
    "ServerConfig.managementPort": [f"{_TLS}::test_planes_merge_when_ports_are_equal",
                                    f"{_TLS}::test_https_and_mutual_tls_on_three_planes"],
    "ServerConfig.metricsPort": [f"{_TLS}::test_planes_merge_when_ports_are_equal",
                                 f"{_TLS}::test_https_and_mutual_tls_on_three_planes"],
    "ServerConfig.allowAllZeroIpListening": _here("test_all_zero_ip_listening") + [
        f"{_CFG}::test_cross_field_checks", f"{_CFG}::test_all_zero_ip_allowed_when_enabled"],
    "ServerConfig.maxLinkNum": ["tests/test_admission.py::test_burst_of_10x_admits_exactly_the_limit",
                                "tests/test_admission.py::test_two_frontends_share_one_limit"],
    "ServerConfig.httpsEnabled": [f"{_TLS}::test_https_and_mutual_tls_on_three_planes",
                                  f"{_TLS}::test_plain_http_quick_start_is_unchanged"],
    "ServerConfig.tlsCaPath": _here("test_tls_ca_path_is_shared_by_all_planes") + [
        f"{_TLS}::test_https_and_mutual_tls_on_three_planes"],
    "ServerConfig.tlsCaFile": _PLANE_TLS + [f"{_TLS}::test_missing_and_unreadable_files",
                                            f"{_TLS}::test_server_only_tls_is_said_and_crl_needs_a_ca"],
    "ServerConfig.tlsCert": _PLANE_TLS + [f"{_TLS}::test_expired_not_yet_valid_and_mismatched"],
    "ServerConfig.tlsPk": _PLANE_TLS + [f"{_TLS}::test_a_bad_tls_file_stops_the_start_naming_the_key"],
    "ServerConfig.tlsPkPwd": _PLANE_TLS + [f"{_TLS}::test_encrypted_key_with_a_password_file"],
    "ServerConfig.tlsCrlPath": _PLANE_TLS,
    "ServerConfig.tlsCrlFiles": _PLANE_TLS + [f"{_TLS}::test_server_only_tls_is_said_and_crl_needs_a_ca"],
    **{f"ServerConfig.{plane}Tls{key}": _PLANE_TLS
       for plane in ("management", "metrics") for key in ("CaFile", "Cert", "Pk", "PkPwd", "CrlPath", "CrlFiles")},
    "ServerConfig.fullTextEnabled": _here("test_e2e_full_text_stream"),
    "ServerConfig.tokenTimeout": _here("test_e2e_token_timeout",
                                       "test_dynamic_adjust_timeout_reaches_the_front_end_deadlines"),
    "ServerConfig.e2eTimeout": [f"{_E2E}::test_timeouts_sighup_sigterm_and_config_keys_take_effect"] + _here(
        "test_dynamic_adjust_timeout_reaches_the_front_end_deadlines"),
    "ServerConfig.maxRequestLength": [f"{_E2E}::test_body_too_large"],
    "ServerConfig.headTimeoutS": [f"{_CFG}::test_receive_timeouts_from_file_and_environment",
                                  "tests/test_fuzz.py::test_stalled_clients_are_cut_at_the_receive_timeouts",
                                  "tests/test_fuzz.py::test_requests_cut_at_random_points_time_out",
                                  f"{_TLS}::test_https_and_mutual_tls_on_three_planes"],
    "ServerConfig.bodyTimeoutS": [f"{_CFG}::test_receive_timeouts_from_file_and_environment",
                                  "tests/test_fuzz.py::test_stalled_clients_are_cut_at_the_receive_timeouts",
                                  "tests/test_admission.py::test_slow_bodies_give_their_slots_back_at_the_body_timeout"],
    "ServerConfig.HealthCheckConfig.npuUsageThreshold": [UNAPPLIED],
    "ServerConfig.watermarkGamma": _here("test_watermark_gamma_and_delta_reach_the_sampler"),
    "ServerConfig.watermarkDelta": _here("test_watermark_gamma_and_delta_reach_the_sampler"),
    "ServerConfig.runDir": _here("test_run_dir_holds_the_worker_sockets",
                                 "test_e2e_listens_on_ip_address_port_and_run_dir"),
    "ServerConfig.frontendCount": [f"{_E2E}::test_timeouts_sighup_sigterm_and_config_keys_take_effect",
                                   f"{_CFG}::test_frontend_count_from_file_and_environment"],
    "ServerConfig.strictConfig": [f"{_CFG}::test_strict_config_refuses_an_unknown_key_naming_it",
                                  f"{_CFG}::test_launcher_warns_on_a_typo_and_refuses_it_with_strict_config"],
    "ServerConfig.drainTimeoutS": ["tests/test_stop.py::test_a_stop_drains_then_cuts_every_family_with_a_final_error",
                                   "tests/test_deploy.py::test_deployment_agrees_with_the_config_and_the_scripts"],
    "ServerConfig.responsesStorePath": ["tests/test_responses.py::test_responses_store_path_key",
                                        "tests/test_responses.py::test_store_get_delete_and_another_process_sees_it"],
    "ServerConfig.enablePromptTokensDetails": [
        "tests/test_partial_prefix.py::test_a_short_system_prompt_is_reused_through_the_server",
        "tests/test_openai.py::test_stream_completion"],
    "ServerConfig.inferMode": ["tests/test_pd.py::test_roles_reported_and_enforced"],
    "ServerConfig.pdRole": ["tests/test_pd.py::test_roles_reported_and_enforced"],
    "ServerConfig.kvTransferLeaseMs": ["tests/test_pd.py::test_sender_dies_mid_transfer_blocks_freed_within_lease"],
    "ServerConfig.kvTransferTimeoutMs": ["tests/test_pd.py::test_lost_transfer_times_out"],
    "ServerConfig.kvLoadFailurePolicy": ["tests/test_pd.py::test_corrupt_transfer_fails_loudly_or_recomputes",
                                         "tests/test_pd.py::test_lost_transfer_times_out"],
    "ServerConfig.interCommPort": ["tests/test_pd_tcp.py::test_greedy_over_tcp_curve_equals_hybrid",
                                   "tests/test_pd_tcp.py::test_config_tcp_kv_endpoint"],
    "ServerConfig.kvTransferHost": ["tests/test_pd_tcp.py::test_config_tcp_kv_endpoint",
                                    "tests/test_pd_coordinator_deploy.py::test_pd_manifests_two_statefulsets_behind_the_coordinator"],
    "ServerConfig.kvTransferTcpOnly": ["tests/test_pd_tcp.py::test_tcp_endpoints_advertised",
                                       "tests/test_pd_tcp.py::test_config_tcp_kv_endpoint"],
    # -- BackendConfig
    "BackendConfig.npuDeviceIds": _here("test_npu_device_ids_make_one_worker_per_entry",
                                        "test_device_groups_launch_as_tensor_parallel_instances") + [
        "tests/test_tensor_parallel.py::test_server_of_two_tp_instances_survives_a_rank_kill"],
    "BackendConfig.deviceType": _here("test_device_type_picks_the_backend"),
    "BackendConfig.cpuThreadsPerWorker": _here("test_cpu_threads_per_worker", "test_e2e_worker_applies_its_keys"),
    "BackendConfig.workerHost": [f"{_CURVE}::test_tcp_without_keys_is_refused_unless_insecure",
                                 f"{_CURVE}::test_worker_host_and_port_checked", f"{_CURVE}::test_ipv6_endpoints",
                                 f"{_CURVE}::test_plain_tcp_with_the_insecure_flag",
                                 "tests/test_remote_workers.py::test_front_ends_and_workers_on_two_hosts",
                                 "tests/test_remote_workers.py::test_split_roles_need_tcp"],
    "BackendConfig.workerHosts": [f"{_CURVE}::test_worker_host_and_port_checked", f"{_CURVE}::test_worker_hosts_plan",
                                  "tests/test_remote_workers.py::test_front_ends_over_two_worker_hosts_survive_a_partition"],
    "BackendConfig.workerPort": [f"{_CURVE}::test_tcp_without_keys_is_refused_unless_insecure",
                                 f"{_CURVE}::test_worker_host_and_port_checked",
                                 f"{_CURVE}::test_worker_reports_a_port_in_use"],
    "BackendConfig.workerCurveKeyDir": [f"{_CURVE}::test_curve_link_serves_the_right_front_end_only",
                                        f"{_CURVE}::test_key_dir_relative_to_the_config_file",
                                        f"{_CURVE}::test_missing_key_file_is_refused",
                                        f"{_CURVE}::test_readable_secret_key_is_refused"],
    "BackendConfig.workerInsecureTcp": [f"{_CURVE}::test_tcp_without_keys_is_refused_unless_insecure",
                                        f"{_CURVE}::test_plain_tcp_with_the_insecure_flag",
                                        f"{_CURVE}::test_worker_refuses_tcp_without_keys",
                                        f"{_CURVE}::test_client_refuses_tcp_without_keys"],
    # -- BackendConfig.ModelDeployConfig
    "BackendConfig.ModelDeployConfig.maxSeqLen": _here("test_e2e_output_budget", "test_e2e_truncation") + [
        "tests/test_device_workers.py::test_length_cap_and_max_seq_len"],
    "BackendConfig.ModelDeployConfig.maxInputTokenLen": _here("test_e2e_truncation") + [
        f"{_CFG}::test_max_input_token_len_clamped_and_prefill_tokens_raised"],
    "BackendConfig.ModelDeployConfig.truncation": _here("test_e2e_truncation") + [
        "tests/test_validation.py::test_truncation_config_values"],
    "BackendConfig.ModelDeployConfig.ModelConfig": _here("test_every_model_config_is_a_model",
                                                         "test_unapplied_keys_are_logged"),
    # -- BackendConfig.ModelDeployConfig.ModelConfig[]
    "BackendConfig.ModelDeployConfig.ModelConfig[].modelName": _here("test_e2e_model_name_and_weight_path") + [
        f"{_E2E}::test_timeouts_sighup_sigterm_and_config_keys_take_effect", f"{_CFG}::test_model_name_follows_the_checkpoint_unless_given"],
    "BackendConfig.ModelDeployConfig.ModelConfig[].modelWeightPath": _here(
        "test_e2e_model_name_and_weight_path", "test_model_weight_path_must_be_a_checkpoint"),
    # worldSize is checked against the groups and against the model's shapes (the groups set the TP size).
    "BackendConfig.ModelDeployConfig.ModelConfig[].worldSize": _here(
        "test_world_size_must_match_the_device_group", "test_a_model_that_does_not_split_is_refused_naming_world_size") + [
        f"{_CFG}::test_cross_field_checks"],
    "BackendConfig.ModelDeployConfig.ModelConfig[].npuMemSize": _here("test_npu_and_cpu_mem_size_size_the_kv_cache"),
    "BackendConfig.ModelDeployConfig.ModelConfig[].cpuMemSize": _here("test_npu_and_cpu_mem_size_size_the_kv_cache",
                                                                       "test_e2e_worker_applies_its_keys"),
    "BackendConfig.ModelDeployConfig.ModelConfig[].dtype": _here("test_dtype_is_the_models_dtype"),
    "BackendConfig.ModelDeployConfig.maxLoadedModels": _here("test_every_model_config_is_a_model") + [
        "tests/test_many_models.py::test_answers_as_alone_before_and_after_reload",
        "tests/test_many_models.py::test_concurrent_requests_over_both_models_complete",
        f"{_CFG}::test_range_violation_names_dotted_key"],
    "BackendConfig.ModelDeployConfig.maxLoadedMemSize": _here("test_every_model_config_is_a_model") + [
        "tests/test_many_models.py::test_memory_bound_evicts_idle_models_and_refuses_one_too_big",
        "tests/test_many_models.py::test_a_model_alone_over_the_memory_bound_is_refused",
        f"{_CFG}::test_range_violation_names_dotted_key"],
    "BackendConfig.ModelDeployConfig.enableSleepMode": [
        "tests/test_many_models.py::test_sleep_mode_serves_one_model_through_the_host"],
    "BackendConfig.ModelDeployConfig.keepAlive": _here("test_every_model_config_is_a_model") + [
        "tests/test_many_models.py::test_ollama_keep_alive_zero_unloads_after_the_request",
        f"{_CFG}::test_range_violation_names_dotted_key"],
    "BackendConfig.ModelDeployConfig.maxLoras": [
        f"{_LORA}::test_least_recently_used_adapter_leaves_memory_first",
        f"{_LORA}::test_fifth_adapter_evicts_the_least_recently_used", f"{_CFG}::test_lora_keys_mindie_example"],
    "BackendConfig.ModelDeployConfig.maxLoraRank": [
        f"{_LORA}::test_refusals_name_the_problem", f"{_CFG}::test_lora_keys_mindie_example"],
    "BackendConfig.ModelDeployConfig.loraRoot": [
        f"{_LORA}::test_adapters_load_only_from_under_lora_root_and_no_path_is_told_apart",
        f"{_LORA}::test_no_lora_root_no_loading_at_run_time"],
    "BackendConfig.ModelDeployConfig.LoraModules": [
        f"{_LORA}::test_server_outputs_equal_peft_on_every_api", f"{_LORA}::test_lora_modules_refused_at_launch",
        f"{_CFG}::test_cross_field_checks"],
    "BackendConfig.ModelDeployConfig.LoraModules[].name": [
        f"{_LORA}::test_models_lists_the_adapters", f"{_CFG}::test_cross_field_checks"],
    "BackendConfig.ModelDeployConfig.LoraModules[].path": [
        f"{_LORA}::test_lora_modules_refused_at_launch", f"{_CFG}::test_lora_keys_mindie_example"],
    "BackendConfig.ModelDeployConfig.LoraModules[].baseModelName": [f"{_CFG}::test_cross_field_checks"],
    "BackendConfig.ModelDeployConfig.ModelConfig[].models": [
        f"tests/test_reasoning.py::{n}" for n in ("test_config_keys", "test_chosen_by_config",
                                                  "test_r1_answer_starts_inside_the_thinking",
                                                  "test_thinking_budget_cuts_the_thinking")] + [
        "tests/test_tool_calls.py::test_config_keys_choose_parser_and_template",
        "tests/test_tool_calls.py::test_none_and_auto_on_the_server"],
    "BackendConfig.ModelDeployConfig.ModelConfig[].reasoningParser": [
        f"tests/test_reasoning.py::{n}" for n in ("test_config_keys", "test_chosen_by_config",
                                                  "test_qwen3_answer_is_split_as_the_parser_says")],
    "BackendConfig.ModelDeployConfig.ModelConfig[].rerank": [
        f"tests/test_rerank.py::{n}" for n in ("test_rerank_config_keys", "test_scorer_rules",
                                               "test_decoder_reranker_equals_transformers",
                                               "test_plain_model_cannot_rerank")],
    "BackendConfig.ModelDeployConfig.ModelConfig[].rerankTemplate": [
        f"tests/test_rerank.py::{n}" for n in ("test_rerank_config_keys", "test_scorer_rules")],
    "BackendConfig.ModelDeployConfig.ModelConfig[].embeddingPooling": [
        f"tests/test_embeddings.py::{n}" for n in ("test_embedding_pooling_key_and_sentence_transformers_files",
                                                   "test_default_model_last_token_normalised_equals_transformers",
                                                   "test_sentence_transformers_mean_pooling_equals_transformers")],
    "BackendConfig.ModelDeployConfig.ModelConfig[].moeParallel": [
        f"tests/test_moe.py::{n}" for n in ("test_moe_parallel_key_reaches_the_worker_and_is_checked_at_launch",
                                            "test_tensor_parallel_moe_generates_what_one_process_does")],
    "BackendConfig.ModelDeployConfig.ModelConfig[].quantize": [
        f"tests/test_int8.py::{n}" for n in ("test_quantize_reaches_the_worker_spec", "test_int8_path_is_used_when_configured",
                                             "test_backend_without_int8_refuses_the_key",
                                             "test_whole_model_logits_match_the_dequantised_reference",
                                             "test_nothing_changes_when_not_configured")] + [
        f"tests/test_w8a8.py::{n}" for n in ("test_quantize_w8a8_against_float_and_dequantised",
                                             "test_refusals_name_the_key")],
    # -- BackendConfig.ScheduleConfig
    "BackendConfig.ScheduleConfig.cacheBlockSize": _here("test_cache_block_size_is_the_engines_block_size",
                                                         "test_e2e_worker_applies_its_keys"),
    "BackendConfig.ScheduleConfig.maxPrefillBatchSize": _here("test_max_prefill_batch_size_caps_admissions_per_step"),
    "BackendConfig.ScheduleConfig.maxPrefillTokens": _here("test_max_prefill_tokens_is_the_schedulers_budget"),
    "BackendConfig.ScheduleConfig.maxBatchSize": _here("test_max_batch_size_caps_running_requests"),
    "BackendConfig.ScheduleConfig.maxIterTimes": _here("test_e2e_output_budget") + [
        "tests/test_validation.py::test_max_new_tokens_budget"],
    "BackendConfig.ScheduleConfig.maxN": ["tests/test_openai.py::test_max_n_caps_the_choices"],
    "BackendConfig.ScheduleConfig.enablePrefixCache": _here("test_enable_prefix_cache"),
    "BackendConfig.ScheduleConfig.overlapSteps": _here("test_overlap_steps_moves_compute_to_a_thread",
                                                       "test_e2e_worker_applies_its_keys") + [
        f"{_CFG}::test_overlap_steps_reaches_the_worker_spec"],
    "BackendConfig.ScheduleConfig.prefillChunkTokens": _here("test_prefill_chunk_tokens_bounds_prompt_tokens_per_step"),
    "BackendConfig.ScheduleConfig.decodeHoldMs": _here("test_decode_hold_ms_puts_prompt_completing_steps_first",
                                                       "test_decode_hold_ms_bounds_the_wait_of_running_requests",
                                                       "test_e2e_worker_applies_its_keys",
                                                       "test_e2e_prompts_go_first_and_are_counted"),
    "BackendConfig.ScheduleConfig.decodeHoldWave": _here("test_decode_hold_wave_prefills_a_burst_before_decodes_resume"),
    "BackendConfig.ScheduleConfig.jumpForward": ["tests/test_constrained.py::test_jump_forward_key_reaches_the_engine",
                                                 "tests/test_constrained.py::test_mixed_batch_and_jump_forward"],
    "BackendConfig.ScheduleConfig.batchInvariant": [
        "tests/test_batch_invariance_server.py::test_greedy_answers_and_logprobs_are_the_same_alone_and_in_mixes",
        "tests/test_engine_settings.py::test_each_key_reaches_the_plan_from_the_file_and_from_its_variable"],
    # -- speculative decoding (tests/test_speculative*.py)
    "BackendConfig.ScheduleConfig.speculativeDecoding": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_speculation_counted_on_metrics_and_in_the_request_log"],
    "BackendConfig.ScheduleConfig.speculationMethod": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_config_refusals",
        "tests/test_speculative.py::test_suffix_proposer_follows_the_longest_match_and_its_most_frequent_continuation",
        "tests/test_speculative.py::test_suffix_controller_keeps_what_pays_for_its_rows"],
    "BackendConfig.ScheduleConfig.promptLookupMin": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_config_refusals", "tests/test_speculative.py::test_ngram_proposes_after_the_latest_longest_match"],
    "BackendConfig.ScheduleConfig.promptLookupMax": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative.py::test_ngram_proposes_after_the_latest_longest_match"],
    "BackendConfig.ScheduleConfig.speculationMaxBatch": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative.py::test_speculation_max_batch_backs_off_under_load"],
    "BackendConfig.ScheduleConfig.speculationMaxStretch": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_config_refusals",
        "tests/test_speculative_server.py::test_each_worker_says_at_start_whether_it_speculates",
        "tests/test_speculative.py::test_a_step_is_stretched_at_most_max_stretch_times"],
    "BackendConfig.ScheduleConfig.speculationMinAcceptance": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_config_refusals",
        "tests/test_speculative.py::test_controller_backs_off_on_low_acceptance"],
    "BackendConfig.ModelDeployConfig.speculationGamma": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_config_refusals"],
    "BackendConfig.ModelDeployConfig.ModelConfig[].plugin_params": [
        "tests/test_speculative_server.py::test_config_reaches_the_engine",
        "tests/test_speculative_server.py::test_config_refusals",
        "tests/test_speculative.py::test_same_outputs_with_and_without_speculation"],
    # -- engine and kernel settings (tests/test_engine_settings.py: file and override reach the plan and the worker)
    "BackendConfig.tpStartTimeoutS": _ES + ["tests/test_tensor_parallel.py::test_startup_names_the_rank_that_did_not_come_up"],
    "BackendConfig.tpCollectiveTimeoutS": _ES + [
        "tests/test_tensor_parallel.py::test_a_hung_rank_is_detected_by_the_collective_timeout"],
    "BackendConfig.gcFreeze": _ES[:1] + ["tests/test_gc_freeze.py::test_freeze_takes_the_start_up_heap_out_of_full_collections",
                                         "tests/test_gc_freeze.py::test_server_freezes_worker_and_front_end"],
    "BackendConfig.cpuTuning.kernels": _ES[:1] + ["tests/test_cpu_kernels.py::test_falls_back_to_portable_attention"],
    "BackendConfig.cpuTuning.isa": _ES + ["tests/test_cpu_isa.py::test_kernels_without_avx512_build_and_pass",
                                          "tests/test_cpu_isa.py::test_bad_isa_name_falls_back_with_a_reason"],
    "BackendConfig.cpuTuning.kernelCache": _ES + ["tests/test_cpu_kernels.py::test_cpu_backend_uses_kernels_when_built"],
    "BackendConfig.cpuTuning.nativeBf16": _ES + ["tests/test_cpu_isa.py::test_auto_dtype_follows_the_cpu",
                                                 "tests/test_cpu_isa.py::test_native_bf16_detection"],
    "BackendConfig.cpuTuning.linearBuckets": _ES + ["tests/test_memory.py::test_row_buckets_bounded_and_exact"],
    "BackendConfig.cpuTuning.prewarmGflop": _ES[:1] + ["tests/test_memory.py::test_rss_flat_under_mixed_load"],
    "BackendConfig.cpuTuning.fusedDecode": _ES[:1] + [
        "tests/test_cpu_decode.py::test_models_and_settings_it_does_not_cover",
        "tests/test_cpu_decode.py::test_server_generates_the_same_tokens_with_and_without_it"],
    "BackendConfig.cpuTuning.fusedDecodeRows": _ES + [
        "tests/test_cpu_decode.py::test_large_steps_and_prefills_keep_the_eager_path"],
    "BackendConfig.cpuTuning.ggufCompute": _ES + ["tests/test_gguf_kernels.py::test_tiny_model_native_against_dequantised",
                                                  "tests/test_gguf.py::test_real_file_dequantised_as_transformers",
                                                  "tests/test_gguf_native_server.py::"
                                                  "test_auto_keeps_the_blocks_where_the_cpu_has_no_native_bf16"],
    "BackendConfig.cpuTuning.fusedDecodeMb": _ES + ["tests/test_cpu_decode.py::test_models_and_settings_it_does_not_cover"],
    "BackendConfig.cpuTuning.int8Rows": _ES,
    "BackendConfig.cpuTuning.adaptiveThreads": _ES + ["tests/test_step_width.py::test_worker_steps_narrow_on_a_busy_host"],
    "BackendConfig.cpuTuning.prefillAttention": _ES + [
        "tests/test_cpu_kernels.py::test_prompt_route_is_the_key_and_refuses_other_values",
        "tests/test_cpu_kernels.py::test_prefill_chunks_match_portable",
        "tests/test_cpu_isa.py::test_backend_logs_its_dispatch_once_and_describes_it"],
    "BackendConfig.cpuTuning.prefillLinears": _ES + [
        "tests/test_cpu_decode.py::test_amx_model_computes_a_prompt_alike_fresh_after_a_prefix_and_in_chunks",
        "tests/test_cpu_decode.py::test_prefill_linears_route_picks_the_products_and_refuses_other_values"],
    # -- LogConfig
    "LogConfig.dynamicLogLevel": [f"{_E2E}::test_timeouts_sighup_sigterm_and_config_keys_take_effect", f"{_CFG}::test_python_log_level"],
    "LogConfig.logLevel": [f"{THIS}::test_log_config_keys_reach_the_launch_environment"],
    "LogConfig.logFormat": ["tests/test_request_log.py::test_request_lines_as_json_in_log_files",
                            f"{THIS}::test_log_config_keys_reach_the_launch_environment"],
    "LogConfig.logPath": ["tests/test_request_log.py::test_request_lines_as_json_in_log_files"],
    "LogConfig.logFileSize": ["tests/test_request_log.py::test_text_request_line_and_rotation",
                              f"{THIS}::test_log_config_keys_reach_the_launch_environment"],
    "LogConfig.logFileNum": ["tests/test_request_log.py::test_text_request_line_and_rotation",
                             f"{THIS}::test_log_config_keys_reach_the_launch_environment"],
}


# -------------------------------------------------------------------------------------------------
# The registry against docs/config.md and the test files.
# -------------------------------------------------------------------------------------------------

class DocKey(NamedTuple):
    key: str
    row: str


def documented_keys(text: str) -> list[DocKey]:
    """Keys of the tables under the key sections of docs/config.md ("## Top level", "## `ServerConfig`",
    "### `BackendConfig.ModelDeployConfig`", ...): the backticked names of each row's first cell."""
    out: list[DocKey] = []
    prefix: str | None = None
    in_key_table = False
    for line in text.splitlines():
        heading = re.match(r"^#{2,3}\s+(.*?)\s*$", line)
        if heading:
            title = heading.group(1)
            section = re.fullmatch(r"`([A-Za-z][A-Za-z.\[\]]*)`", title)
            prefix = "" if title == "Top level" else section.group(1) if section else None
            in_key_table = False
            continue
        if prefix is None or not line.startswith("|"):
            in_key_table = in_key_table and line.startswith("|")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "key":
            in_key_table = True
            continue
        if not in_key_table or set(cells[0]) <= set("-: "):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            out.append(DocKey(f"{prefix}.{name}" if prefix else name, line))
    return out


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_registry_covers_every_documented_key_and_nothing_else() -> None:
    doc = documented_keys(DOC.read_text())
    keys = [d.key for d in doc]
    # The parser saw every section (a broken parse must not pass as "nothing documented").
    sections = {k.rsplit(".", 1)[0] if "." in k else "" for k in keys}
    assert {"", "ServerConfig", "BackendConfig", "BackendConfig.ModelDeployConfig",
            "BackendConfig.ModelDeployConfig.ModelConfig[]", "BackendConfig.ScheduleConfig",
            "LogConfig"} <= sections, sections
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    assert sorted(set(keys) - set(KEY_TESTS)) == [], "documented keys without a test in KEY_TESTS"
    assert sorted(set(KEY_TESTS) - set(keys)) == [], "KEY_TESTS names keys docs/config.md does not document"
    assert all(KEY_TESTS[k] for k in keys)


def test_registry_node_ids_exist() -> None:
    functions: dict[str, set[str]] = {}
    missing = []
    for key, ids in KEY_TESTS.items():
        for node in ids:
            path, _, name = node.partition("::")
            name = name.split("[", 1)[0]  # parametrized ids may carry their [param]
            file = ROOT / path
            if path not in functions:
                functions[path] = _test_functions(file) if file.is_file() else set()
            if "::" in name or name not in functions[path]:
                missing.append(f"{key}: {node}")
    assert missing == []


def test_registry_no_effect_keys_map_to_the_launcher_log() -> None:
    """Rows the docs mark "no effect" are shown by the launcher's log line, and only those map there
    (besides ModelConfig, whose extra entries are logged as unused)."""
    no_effect = {d.key for d in documented_keys(DOC.read_text()) if "no effect" in d.row}
    assert no_effect == {"Version", "ServerConfig.HealthCheckConfig.npuUsageThreshold"}
    assert all(UNAPPLIED in KEY_TESTS[k] for k in no_effect)
    from mindie.config import VALIDATED_NOT_APPLIED
    assert set(VALIDATED_NOT_APPLIED) == no_effect


def _config_leaves(tp: Any, path: str, out: set[str]) -> set[str]:
    import typing
    for f in msgspec.structs.fields(tp):
        inner, suffix = f.type, ""
        while typing.get_origin(inner) in (typing.Annotated, list):
            suffix = "[]" if typing.get_origin(inner) is list else suffix
            inner = typing.get_args(inner)[0]
        name = f"{path}.{f.encode_name}" if path else f.encode_name
        if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
            if suffix:
                out.add(name)  # a list of sections (ModelConfig) is a documented key itself
            _config_leaves(inner, name + suffix, out)
        else:
            out.add(name)
    return out


def test_every_config_field_is_documented() -> None:
    """The other direction: every key the server reads (a field of mindie.config.Config) has its row."""
    assert _config_leaves(Config, "", set()) == {d.key for d in documented_keys(DOC.read_text())}


# -------------------------------------------------------------------------------------------------
# Helpers.
# -------------------------------------------------------------------------------------------------

def load(tmp_path: Path, data: dict, env: dict | None = None, name: str = "config.json") -> Loaded:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return load_config(str(path), env=env or {})


def _write(tmp_path: Path, data: dict, name: str = "tp.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def deployment(tmp_path: Path, data: dict, **kw):
    data = json.loads(json.dumps(data))
    data.setdefault("ServerConfig", {}).setdefault("runDir", str(tmp_path / "run"))
    return build_deployment(load(tmp_path, data).config, **kw)


def schedule_config(tmp_path: Path, schedule: dict, deploy: dict | None = None) -> EngineConfig:
    """The EngineConfig the launch plan gives every worker for these ScheduleConfig keys."""
    dep = deployment(tmp_path, {"BackendConfig": {"ModelDeployConfig": deploy or {}, "ScheduleConfig": schedule}})
    engines = {w.engine for w in dep.workers}
    assert len(engines) == 1
    e = engines.pop()
    # The device-dependent keys the test does not set (None until workers.prepare settles them):
    # off, so only the keys under test shape the steps.
    return msgspec.structs.replace(e, prefill_chunk_tokens=0 if e.prefill_chunk_tokens is None else e.prefill_chunk_tokens,
                                   decode_hold_ms=0 if e.decode_hold_ms is None else e.decode_hold_ms,
                                   overlap=False if e.overlap is None else e.overlap)


class StepLog(NamedTuple):
    tokens: int  # tokens computed in the step
    prefills: int  # sequences whose prompt is (partly) computed in it
    seqs: int  # sequences in the step
    running: int  # sequences running after scheduling


def run_engine(cfg: EngineConfig, prompts: list[list[int]], max_new: int, num_blocks: int = 4096,
               runner=None) -> tuple[list[StepLog], Any]:
    """Every step of the real Engine/Scheduler (null model: no compute) serving ``prompts``."""
    from workers.engine.engine import Engine
    from workers.engine.model_runner import NullRunner

    engine = Engine(runner or NullRunner(), cfg, num_blocks)
    for i, ids in enumerate(prompts):
        engine.add(Submit(f"r{i}", "fe", ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
    log = []
    try:
        while engine.has_work():
            flight = engine.launch()
            assert flight is not None, "work left but nothing scheduled"
            b = flight.batch
            log.append(StepLog(sum(b.num_tokens), sum(1 for s in b.seqs if s.num_computed < s.prompt_len),
                               len(b.seqs), engine.num_running))
            engine.collect(flight)
            assert len(log) < 10000
        assert engine.check_no_leaks()
    finally:
        engine.close()
    return log, engine


def distinct_prompts(n: int, length: int) -> list[list[int]]:
    return [[3 + (i * length + j) % 31000 for j in range(length)] for i in range(n)]


# -------------------------------------------------------------------------------------------------
# Keys validated without effect: the launcher logs them.
# -------------------------------------------------------------------------------------------------

def _prepare(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDIE_", "MIES_"))}
    run_dir = tmp_path / "run"
    env.update(MIES_CONFIG_JSON_PATH=str(config), MINDIE_RUN_DIR=str(run_dir), MINDIE_LOG_LEVEL="INFO")
    return subprocess.run([sys.executable, "-m", "mindie.ops.launch_plan"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_log_config_keys_reach_the_launch_environment(tmp_path: Path) -> None:
    """LogConfig's keys become the environment every process's logging reads
    (mindie/runtime/log_setup.py): level (logLevel when dynamicLogLevel is empty), format, a
    logPath relative to the config file, file size and count; a bad value names its key."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"LogConfig": {"logLevel": "debug", "logFormat": "json", "logPath": "logs",
                                                "logFileSize": 3, "logFileNum": 4}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDIE_", "MIES_"))}
    env.update(MIES_CONFIG_JSON_PATH=str(config), MINDIE_RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.run([sys.executable, "-m", "mindie.ops.launch_plan"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert out["MINDIE_LOG_LEVEL"] == "DEBUG"
    assert (out["MINDIE_LOG_FORMAT"], out["MINDIE_LOG_FILE_SIZE"], out["MINDIE_LOG_FILE_NUM"]) == ("json", "3", "4")
    assert out["MINDIE_LOG_PATH"].strip("'") == str(tmp_path / "logs")
    config.write_text(json.dumps({"LogConfig": {"logFormat": "xml"}}))
    bad = subprocess.run([sys.executable, "-m", "mindie.ops.launch_plan"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert "LogConfig.logFormat" in bad.stderr and bad.stdout.strip().endswith("exit 2"), bad.stderr
    config.write_text(json.dumps({"LogConfig": {"logFileSize": 0}}))
    bad = subprocess.run([sys.executable, "-m", "mindie.ops.launch_plan"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert "LogConfig.logFileSize" in bad.stderr, bad.stderr


def test_unapplied_keys_are_logged(tmp_path: Path) -> None:
    """Version and HealthCheckConfig.npuUsageThreshold are validated but do nothing: load_config
    reports each one the file sets (Loaded.unapplied) and the launcher logs it; a second ModelConfig
    entry is a second model (logged; tests/test_many_models.py serves two)."""
    data = {"Version": "2.0.0", "ServerConfig": {"HealthCheckConfig": {"npuUsageThreshold": 50}},
            "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [
                {"modelName": "first"}, {"modelName": "second"}]}}}
    loaded = load(tmp_path, data)
    assert [u.split(":")[0] for u in loaded.unapplied] == [
        "Version", "ServerConfig.HealthCheckConfig.npuUsageThreshold"]
    assert load(tmp_path, {}, name="empty.json").unapplied == []  # only the keys the file sets
    # Still validated: a wrong value is refused.
    with pytest.raises(ConfigError, match=r"^BackendConfig\.ScheduleConfig\.maxN: must be >= 1"):
        load(tmp_path, {"BackendConfig": {"ScheduleConfig": {"maxN": 0}}}, name="bad.json")

    proc = _prepare(tmp_path, tmp_path / "config.json")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^MINDIE_DEPLOYMENT=", proc.stdout, re.M), proc.stdout  # shell assignments on stdout
    said = "config key validated but without effect in this server: "
    for key in ("Version", "ServerConfig.HealthCheckConfig.npuUsageThreshold"):
        assert re.search(rf"{said}{re.escape(key)}: \S", proc.stderr), (key, proc.stderr)
    assert proc.stderr.count(said) == 2
    assert "ModelConfig has 2 entries: each is served under its modelName, at most 2 loaded" in proc.stderr
    # A file without them: not a word.
    (tmp_path / "plain.json").write_text("{}")
    proc = _prepare(tmp_path, tmp_path / "plain.json")
    assert proc.returncode == 0, proc.stderr
    assert said not in proc.stderr


# -------------------------------------------------------------------------------------------------
# Launch plan, front end, listeners.
# -------------------------------------------------------------------------------------------------

def test_every_model_config_is_a_model(tmp_path: Path) -> None:
    """Each entry gets its own worker group with its own keys (mindie/model_plan.py;
    tests/test_many_models.py serves two); maxLoadedModels, keepAlive and maxLoadedMemSize go into
    the plan."""
    from mindie.model_plan import build_many

    models = [{"modelName": "first", "modelWeightPath": "/models/a", "dtype": "bfloat16", "cpuMemSize": 2},
              {"modelName": "second", "modelWeightPath": "/models/b", "dtype": "float16", "cpuMemSize": 3}]
    data = {"BackendConfig": {"npuDeviceIds": [[0], [1]], "ModelDeployConfig": {
        "ModelConfig": models, "maxLoadedModels": 1, "keepAlive": 300, "maxLoadedMemSize": 6.5}},
        "ServerConfig": {"runDir": str(tmp_path / "r")}}
    dep = build_many(load(tmp_path, data).config)
    assert {(w.model_name, w.model_path, w.dtype, w.cpu_mem_gb) for w in dep.workers} == {
        ("first", "/models/a", "bfloat16", 2.0)}
    assert {(w.model_name, w.model_path, w.dtype, w.cpu_mem_gb) for w in dep.models[0]} == {
        ("second", "/models/b", "float16", 3.0)}
    assert (dep.max_loaded_models, dep.keep_alive_s, dep.max_loaded_mem_gb) == (1, 300.0, 6.5)
    bad = models[:1] + [{"dtype": "int8"}]
    with pytest.raises(ConfigError, match=r"ModelConfig\[1\]\.dtype: must be one of"):
        load(tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": bad}}}, name="bad.json")
    with pytest.raises(ConfigError, match=r"ModelConfig: must have length >= 1"):
        load(tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": []}}}, name="empty.json")


def test_model_weight_path_must_be_a_checkpoint(tmp_path: Path, demo_model: str) -> None:
    """The plan carries the path to every worker (and the front end's tokenizer); a directory
    without config.json stops the launch naming the key."""
    from workers.prepare import settle_deployment

    (tmp_path / "m").mkdir()
    data = {"BackendConfig": {"deviceType": "cpu", "npuDeviceIds": [[0], [1]],
                              "ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": demo_model}]}}}
    dep = settle_deployment(deployment(tmp_path, data))
    assert dep.model_dir == demo_model and {w.model_path for w in dep.workers} == {demo_model}
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = "m"  # relative: config's dir
    with pytest.raises(SystemExit, match=r"ModelConfig\[0\]\.modelWeightPath: .*/m has no config\.json"):
        settle_deployment(deployment(tmp_path, data))
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = "nowhere"
    with pytest.raises(SystemExit, match=r"ModelConfig\[0\]\.modelWeightPath: .*/nowhere does not exist"):
        settle_deployment(deployment(tmp_path, data))
    (tmp_path / "f").write_text("not a model")
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = "f"
    with pytest.raises(SystemExit, match=r"ModelConfig\[0\]\.modelWeightPath: .*/f is not a directory"):
        settle_deployment(deployment(tmp_path, data))


def test_world_size_must_match_the_device_group(tmp_path: Path) -> None:
    """worldSize only has to agree with the npuDeviceIds entries (0 = their length): any other
    value is refused, and it changes nothing in the plan."""
    base = {"BackendConfig": {"npuDeviceIds": [[0, 1], [2, 3]], "deviceType": "cuda"}}
    plans = []
    for ws in (0, 2):
        data = json.loads(json.dumps(base))
        data["BackendConfig"]["ModelDeployConfig"] = {"ModelConfig": [{"worldSize": ws}]}
        plans.append(deployment(tmp_path, data))
    assert plans[0] == plans[1]
    data["BackendConfig"]["ModelDeployConfig"] = {"ModelConfig": [{"worldSize": 4}]}
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.worldSize: must equal the number of devices per "
                                          r"npuDeviceIds entry \(2\), got 4"):
        load(tmp_path, data)


def test_device_groups_launch_as_tensor_parallel_instances(tmp_path: Path) -> None:
    """Entries of several devices are tensor-parallel instances: the launch plan keeps the groups,
    and on CPU each rank gets its share of the cores (no core lending between instances)."""
    from mindie.topology import usable_cores

    dep = deployment(tmp_path, {"BackendConfig": {"npuDeviceIds": [[0, 1], [2, 3]], "deviceType": "cpu"}})
    assert [w.device_ids for w in dep.workers] == [[0, 1], [2, 3]]
    assert all(w.threads == max(1, usable_cores() // 4) and not w.core_share_file for w in dep.workers)
    proc = _prepare(tmp_path, _write(tmp_path, {"BackendConfig": {"npuDeviceIds": [[0, 1, 2, 3]]}}))
    assert proc.returncode == 0 and "MINDIE_DEPLOYMENT=" in proc.stdout, proc.stderr


def test_a_model_that_does_not_split_is_refused_naming_world_size(tmp_path: Path, demo_model: str) -> None:
    """workers.prepare (run by launch.sh before any process starts) refuses a world size that
    does not divide the model's heads, naming the key; exit status 2."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(Path(demo_model) / "tokenizer.json", model)  # the front ends' check (mindie.ops.launch_plan)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 48,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 6}))
    data = {"BackendConfig": {"npuDeviceIds": [[0, 1, 2, 3]], "deviceType": "cpu",
                              "ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": str(model)}]}}}
    proc = _prepare(tmp_path, _write(tmp_path, data))
    assert proc.returncode == 0, proc.stderr
    plan = [line.split("=", 1)[1] for line in proc.stdout.splitlines() if line.startswith("MINDIE_DEPLOYMENT=")][0]
    settle = subprocess.run([sys.executable, "-m", "workers.prepare", plan.strip("'")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert settle.returncode == 2, settle.stderr
    assert ("ModelConfig[0].worldSize: 4 ranks cannot split this model: num_attention_heads 6 is not a multiple "
            "of 4") in settle.stderr


def test_npu_device_ids_make_one_worker_per_entry(tmp_path: Path) -> None:
    from workers.supervisor import visibility_env

    for device, var in (("cuda", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")):
        dep = deployment(tmp_path, {"BackendConfig": {"npuDeviceIds": [[2, 3], [4, 5], [6, 7]], "deviceType": device}})
        assert [(w.worker_id, w.device_ids, w.worker_index, w.num_workers) for w in dep.workers] == [
            ("w0", [2, 3], 0, 3), ("w1", [4, 5], 1, 3), ("w2", [6, 7], 2, 3)]
        assert len({w.job_endpoint for w in dep.workers}) == 3
        # What the supervisor puts in each worker's environment: only its own devices.
        assert [visibility_env(w.device_type, w.device_ids) for w in dep.workers] == [
            {var: "2,3"}, {var: "4,5"}, {var: "6,7"}]


def test_device_type_picks_the_backend(tmp_path: Path) -> None:
    """deviceType reaches every worker's spec; the worker builds that backend (get_backend), and
    workers.prepare settles "auto" by probing and sets the device's overlap default."""
    from workers.backends import detect, get_backend
    from workers.prepare import settle_deployment

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a checkpoint directory, as settle_deployment wants

    def settled(device: str) -> WorkerSpec:
        return settle_deployment(deployment(tmp_path, {"BackendConfig": {"deviceType": device, "ModelDeployConfig": {
            "ModelConfig": [{"modelWeightPath": str(model)}]}}})).workers[0]

    for device, cls, overlap in (("cpu", "CpuBackend", False), ("cuda", "CudaBackend", True),
                                 ("npu", "NpuBackend", True)):
        w = settled(device)
        assert (w.device_type, w.engine.overlap) == (device, overlap)
        assert type(get_backend(w.device_type)).__name__ == cls
    dep_auto = settled("auto")
    assert dep_auto.device_type == detect()


def test_cpu_threads_per_worker(tmp_path: Path) -> None:
    """A fixed count: every CPU worker's torch threads, no core lending; 0: the cores shared out
    evenly, idle workers lending theirs."""
    import torch
    from workers.backends.cpu import CpuBackend

    two = {"npuDeviceIds": [[0], [1]], "deviceType": "cpu"}
    dep = deployment(tmp_path, {"BackendConfig": {**two, "cpuThreadsPerWorker": 3}})
    assert [(w.threads, w.core_share_file) for w in dep.workers] == [(3, ""), (3, "")]
    auto = deployment(tmp_path, {"BackendConfig": {**two, "cpuThreadsPerWorker": 0}})
    assert {w.threads for w in auto.workers} == {max(1, (os.cpu_count() or 1) // 2)}
    assert all(w.core_share_file.endswith("cores.busy") for w in auto.workers)
    # The worker's backend applies it to torch (CpuBackend.setup, then on the compute thread).
    before = torch.get_num_threads()
    try:
        CpuBackend(dep.workers[0].threads).setup()
        assert torch.get_num_threads() == 3
        torch.set_num_threads(1)
        CpuBackend(dep.workers[0].threads).bind_thread()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_npu_and_cpu_mem_size_size_the_kv_cache(tmp_path: Path) -> None:
    from workers.attention.kv_cache import budget_bytes

    def free_memory() -> int:  # an accelerator with a known free memory
        return 10 << 30

    def spec(model: dict) -> WorkerSpec:
        return deployment(tmp_path, {"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}}}).workers[0]

    for accelerator in ("cuda", "npu"):
        assert budget_bytes(spec({"npuMemSize": 3}), accelerator, free_memory) == 3 << 30
        assert budget_bytes(spec({"npuMemSize": -1}), accelerator, free_memory) == int((10 << 30) * 0.8)  # a fraction
    assert budget_bytes(spec({"cpuMemSize": 0.5}), "cpu", free_memory) == 1 << 29
    assert budget_bytes(spec({"cpuMemSize": 3}), "cpu", free_memory) == 3 << 30
    assert budget_bytes(spec({"cpuMemSize": 0}), "cpu", free_memory) == 1 << 30  # 0 is loaded as 1


def test_run_dir_holds_the_worker_sockets(tmp_path: Path) -> None:
    run = tmp_path / "private"
    dep = deployment(tmp_path, {"ServerConfig": {"runDir": "private"}, "BackendConfig": {"npuDeviceIds": [[0], [1]]}})
    assert dep.run_dir == str(run)
    assert [(w.job_endpoint, w.pub_endpoint) for w in dep.workers] == [
        (f"ipc://{run}/w{i}-jobs.ipc", f"ipc://{run}/w{i}-frames.ipc") for i in range(2)]
    assert ensure_run_dir(dep.run_dir) == str(run) and (run.stat().st_mode & 0o777) == 0o700


def test_listener_addresses(tmp_path: Path) -> None:
    data = {"ServerConfig": {"ipAddress": "127.0.0.3", "managementIpAddress": "127.0.0.4", "port": 2001,
                             "managementPort": 2002, "metricsPort": 2003}}
    li = plan_listeners(load(tmp_path, data).config.server)
    assert [(x.host, x.port, x.planes) for x in li] == [
        ("127.0.0.3", 2001, ("business",)), ("127.0.0.4", 2002, ("management",)), ("127.0.0.4", 2003, ("metrics",))]
    li = plan_listeners(load(tmp_path, data, env={"MINDIE_HOST": "::1"}).config.server)
    assert li[0].host == "::1"


def test_all_zero_ip_listening(tmp_path: Path) -> None:
    data = {"ServerConfig": {"ipAddress": "0.0.0.0", "managementIpAddress": "::"}}
    with pytest.raises(ConfigError, match=r"^ServerConfig\.ipAddress: 0\.0\.0\.0 listens on every interface; "
                                          r"set ServerConfig\.allowAllZeroIpListening"):
        load(tmp_path, data)
    data["ServerConfig"]["allowAllZeroIpListening"] = True
    li = plan_listeners(load(tmp_path, data).config.server)
    assert [x.host for x in li] == ["0.0.0.0", "::", "::"]


def test_dynamic_adjust_timeout_reaches_the_front_end_deadlines(tmp_path: Path, demo_model: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The front end's limits (mindie/server/frontend.py) and a request's deadlines follow tokenTimeout and
    e2eTimeout, both at their maximum with EnableDynamicAdjustTimeoutConfig."""
    from mindie.text.generation import Deadline as Deadlines
    from mindie.server.frontend import FrontEnd
    from workers.prepare import settle_deployment

    monkeypatch.setattr("mindie.server.frontend.Metrics", lambda name: None)  # prometheus' registry is per process

    def front_end(flag: bool):
        data = {"EnableDynamicAdjustTimeoutConfig": flag,
                "ServerConfig": {"tokenTimeout": 5, "e2eTimeout": 7, "runDir": short_run_dir()},
                "BackendConfig": {"deviceType": "cpu",
                                  "ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": demo_model}]}}}
        config = load(tmp_path, data).config
        ensure_run_dir(config.server.run_dir)
        fe = FrontEnd(config, settle_deployment(build_deployment(config)))
        asyncio.run(fe.client.close())
        fe.admission.close()
        return fe

    for flag, token, e2e in ((False, 5, 7), (True, 3600, 65535)):
        lim = front_end(flag).limits
        assert (lim.token_timeout, lim.e2e_timeout) == (token, e2e)
        t0 = time.monotonic()
        deadline, what = Deadlines(None, lim.token_timeout, lim.e2e_timeout, stream=False).next()
        assert what == "server tokenTimeout" and deadline - t0 == pytest.approx(token, abs=1)
        d = Deadlines(None, lim.token_timeout, lim.e2e_timeout, stream=True)
        d.mark += e2e - 1  # a stream whose last token came just before its e2e limit: that limit is next
        deadline, what = d.next()
        assert what == "server e2eTimeout" and deadline - t0 == pytest.approx(e2e, abs=1)


# -------------------------------------------------------------------------------------------------
# TLS files of each plane (in-process handshakes; tests/test_tls.py starts the real server).
# -------------------------------------------------------------------------------------------------

_PREFIX = {"business": "tls", "management": "managementTls", "metrics": "metricsTls"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization
    from tests.certs import Pki, pem_key, write

    p = Pki(tmp_path_factory.mktemp("pki"))
    # Each plane's key again, encrypted, with its password file.
    for plane in _PREFIX:
        pk = serialization.load_pem_private_key((p.root / f"security/keys/{plane}/server.key.pem").read_bytes(), None)
        write(p.root / f"enc/{plane}.key.pem", pem_key(pk, f"pw-{plane}".encode()))
        write(p.root / f"enc/{plane}.pwd", f"pw-{plane}\n".encode())
    write(p.root / "enc/wrong.pwd", b"nope\n")
    return p


def _plane_ctx(pki, plane: str, **server) -> ssl.SSLContext:
    """The server context a front end builds for ``plane`` from a config with the pki's files."""
    from mindie.runtime.tls import check_plane, plane_tls

    path = pki.root / f"cfg-{plane}-{abs(hash(json.dumps(server, sort_keys=True)))}.json"
    path.write_text(json.dumps({"ServerConfig": {**pki.server_config(), **server}}))
    ctx, _ = check_plane(plane_tls(load_config(str(path), env={}).config.server, plane))
    return ctx


def _client(pki, who: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.root / "security/ca/ca.pem"))
    if who:
        cert, key, _ = getattr(pki, who)
        ctx.load_cert_chain(cert, key)
    return ctx


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[int | None, bool]:
    """(serial of the certificate the server presented, whether the server accepted the client)."""
    from cryptography import x509

    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    accepted: list[bool] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.sendall(b"ok")
                accepted.append(True)
        except (ssl.SSLError, OSError):
            accepted.append(False)

    t = threading.Thread(target=serve)
    t.start()
    serial = None
    try:
        with client.wrap_socket(b, server_hostname="127.0.0.1") as c:
            serial = x509.load_der_x509_certificate(c.getpeercert(binary_form=True)).serial_number
            try:
                c.recv(2)
            except (ssl.SSLError, OSError):
                pass
    except (ssl.SSLError, OSError):
        pass
    t.join(10)
    a.close()
    b.close()
    return serial, accepted == [True]


@pytest.mark.parametrize("plane", list(_PREFIX))
def test_tls_keys_of_each_plane(pki, plane: str) -> None:
    """Each plane's Cert/Pk is the certificate it presents, its CaFile the CAs its clients must
    chain to, its CrlPath/CrlFiles the revocations it checks, its PkPwd the password of its key;
    changing one plane's key changes that plane only."""
    from mindie.runtime.tls import TlsError

    k = _PREFIX[plane]
    others = [p for p in _PREFIX if p != plane]
    ctx = _plane_ctx(pki, plane)
    serial = getattr(pki, f"{plane}_cert").serial_number
    assert _handshake(ctx, _client(pki, "client")) == (serial, True)
    assert _handshake(ctx, _client(pki, "stranger"))[1] is False  # CaFile: another CA's client
    assert _handshake(ctx, _client(pki, "revoked"))[1] is False  # CrlFiles in CrlPath
    assert _handshake(ctx, _client(pki, None))[1] is False  # mutual TLS
    # Cert/Pk: another plane's pair is served when named here.
    other = others[0]
    ctx = _plane_ctx(pki, plane, **{f"{k}Cert": f"security/certs/{other}/server.pem",
                                    f"{k}Pk": f"security/keys/{other}/server.key.pem"})
    assert _handshake(ctx, _client(pki, "client")) == (getattr(pki, f"{other}_cert").serial_number, True)
    # CrlFiles [] : the revoked client gets in; CaFile [] : no client certificate asked for.
    assert _handshake(_plane_ctx(pki, plane, **{f"{k}CrlFiles": []}), _client(pki, "revoked"))[1] is True
    assert _handshake(_plane_ctx(pki, plane, **{f"{k}CrlFiles": [], f"{k}CaFile": []}), _client(pki, None))[1]
    # CrlPath: where the CRL files are looked up.
    with pytest.raises(TlsError) as e:
        _plane_ctx(pki, plane, **{f"{k}CrlPath": "security/elsewhere/"})
    assert e.value.key == f"ServerConfig.{k}CrlFiles" and "security/elsewhere/ca_crl.pem does not exist" in str(e.value)
    # PkPwd: the password of an encrypted key.
    enc = {f"{k}Pk": f"enc/{plane}.key.pem"}
    ctx = _plane_ctx(pki, plane, **enc, **{f"{k}PkPwd": f"enc/{plane}.pwd"})
    assert _handshake(ctx, _client(pki, "client")) == (serial, True)
    with pytest.raises(TlsError) as e:
        _plane_ctx(pki, plane, **enc)
    assert e.value.key == f"ServerConfig.{k}Pk" and "is encrypted" in str(e.value)
    with pytest.raises(TlsError) as e:
        _plane_ctx(pki, plane, **enc, **{f"{k}PkPwd": "enc/wrong.pwd"})
    assert e.value.key == f"ServerConfig.{k}PkPwd" and "wrong password" in str(e.value)
    # The other planes do not read this plane's keys.
    broken = {f"{k}Cert": "security/none.pem", f"{k}Pk": "none", f"{k}CaFile": ["none.pem"], f"{k}PkPwd": "none",
              f"{k}CrlPath": "none/"}
    for p in others:
        assert _handshake(_plane_ctx(pki, p, **broken), _client(pki, "client")) == (
            getattr(pki, f"{p}_cert").serial_number, True)


def test_tls_ca_path_is_shared_by_all_planes(pki) -> None:
    """tlsCaPath is the directory of every plane's CA files: pointed at a directory whose ca.pem is
    another CA, every plane takes that CA's clients and refuses the test CA's."""
    from tests.certs import pem_cert, write

    write(pki.root / "other-ca/ca.pem", pem_cert(pki.other_ca.cert), 0o644)
    no_crl = {f"{k}CrlFiles": [] for k in _PREFIX.values()}
    for plane in _PREFIX:
        ctx = _plane_ctx(pki, plane, tlsCaPath="other-ca/", **no_crl)
        assert _handshake(ctx, _client(pki, "stranger"))[1] is True
        assert _handshake(ctx, _client(pki, "client"))[1] is False
        assert _handshake(_plane_ctx(pki, plane, **no_crl), _client(pki, "stranger"))[1] is False


# -------------------------------------------------------------------------------------------------
# The engine: scheduler, block manager, compute thread (real classes, null model).
# -------------------------------------------------------------------------------------------------

def test_max_prefill_tokens_is_the_schedulers_budget(tmp_path: Path) -> None:
    """No step computes more than maxPrefillTokens tokens, and full steps use the whole budget; a
    value below maxInputTokenLen is raised at load (MindIE) and the raised value is the budget."""
    deploy = {"maxSeqLen": 256, "maxInputTokenLen": 64}
    prompts = distinct_prompts(8, 60)
    for prefill, budget in ((100, 100), (50, 64 + 8)):  # raised to min(maxSeqLen, maxInputTokenLen + maxIterTimes)
        cfg = schedule_config(tmp_path, {"maxPrefillTokens": prefill, "maxIterTimes": 8}, deploy)
        assert cfg.max_prefill_tokens == budget
        log, _ = run_engine(cfg, prompts, max_new=4)
        assert max(s.tokens for s in log) == budget
        assert sum(s.tokens for s in log) == 8 * (60 + 4 - 1)  # every prompt and decode computed once
    # The default budget (8192) takes all eight prompts in the first step.
    log, _ = run_engine(schedule_config(tmp_path, {"maxIterTimes": 8}, deploy), prompts, max_new=4)
    assert log[0].tokens == 8 * 60


def test_max_prefill_batch_size_caps_admissions_per_step(tmp_path: Path) -> None:
    cfg = schedule_config(tmp_path, {"maxPrefillBatchSize": 3, "maxBatchSize": 20})
    assert cfg.max_prefill_batch_size == 3
    log, _ = run_engine(cfg, distinct_prompts(12, 5), max_new=4)
    assert max(s.prefills for s in log) == 3 and log[0].prefills == 3
    log, _ = run_engine(schedule_config(tmp_path, {"maxPrefillBatchSize": 12, "maxBatchSize": 20}),
                        distinct_prompts(12, 5), max_new=4)
    assert log[0].prefills == 12


def test_max_batch_size_caps_running_requests(tmp_path: Path) -> None:
    cfg = schedule_config(tmp_path, {"maxBatchSize": 4, "maxPrefillBatchSize": 4})
    assert cfg.max_batch_size == 4
    log, _ = run_engine(cfg, distinct_prompts(10, 5), max_new=6)
    assert max(s.running for s in log) == 4 and max(s.seqs for s in log) == 4
    log, _ = run_engine(schedule_config(tmp_path, {"maxBatchSize": 10, "maxPrefillBatchSize": 10}),
                        distinct_prompts(10, 5), max_new=6)
    assert max(s.running for s in log) == 10


def test_cache_block_size_is_the_engines_block_size(tmp_path: Path) -> None:
    from workers.engine.engine import Engine
    from workers.engine.model_runner import NullRunner

    cfg = schedule_config(tmp_path, {"cacheBlockSize": 48})
    assert cfg.block_size == 48
    engine = Engine(NullRunner(), cfg, 64)
    seq = engine.add(Submit("r", "fe", list(range(3, 103)), SamplingParams(max_new_tokens=4, ignore_eos=True)))
    engine.step()
    assert engine.blocks.block_size == 48 and len(seq.block_table) == math.ceil(100 / 48)
    assert engine.blocks.num_free == 64 - 3
    engine.close()


def test_enable_prefix_cache(tmp_path: Path) -> None:
    """With the prefix cache a repeated prompt computes only its last partial block; without it,
    the whole prompt again."""
    from workers.engine.engine import Engine
    from workers.engine.model_runner import NullRunner

    prompt = list(range(3, 103))  # 100 tokens: three full 32-token blocks and 4 more
    first_step = {}
    for on in (True, False):
        cfg = schedule_config(tmp_path, {"enablePrefixCache": on, "cacheBlockSize": 32})
        assert cfg.enable_prefix_cache is on
        engine = Engine(NullRunner(), cfg, 64)
        for rid in ("a", "b"):
            engine.add(Submit(rid, "fe", prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)))
            flight = engine.launch()
            first_step[(on, rid)] = flight.batch.num_tokens[0]
            engine.collect(flight)
            while engine.has_work():
                engine.step()
        assert (engine.blocks.prefix_hits > 0) is on
        engine.close()
    assert first_step == {(True, "a"): 100, (True, "b"): 4, (False, "a"): 100, (False, "b"): 100}


def test_prefill_chunk_tokens_bounds_prompt_tokens_per_step(tmp_path: Path) -> None:
    """prefillChunkTokens reaches the engine (null = the device's default: 128 on cpu, 2048 on
    accelerators; 0 = maxPrefillTokens). While several requests have work a step computes at most
    that many tokens, its decodes included; a prompt alone takes up to maxPrefillTokens."""
    from mindie.contract import wire as P
    from workers.engine.engine import Engine
    from workers.engine.model_runner import NullRunner
    from workers.prepare import settle

    def engine_cfg(value, device="cpu", hold=None):
        data = {"BackendConfig": {"ScheduleConfig": {"cacheBlockSize": 16, "maxPrefillTokens": 4096,
                                                     **({} if value == "absent" else {"prefillChunkTokens": value}),
                                                     **({} if hold is None else {"decodeHoldMs": hold})}}}
        return settle(deployment(tmp_path, data).workers[0], device, "/m").engine

    assert [engine_cfg(v).prefill_chunk_tokens for v in ("absent", None, 0, 96)] == [128, 128, 0, 96]
    assert engine_cfg(None, "npu").prefill_chunk_tokens == 2048
    with pytest.raises(ConfigError, match=r"ScheduleConfig\.prefillChunkTokens"):
        load(tmp_path, {"BackendConfig": {"ScheduleConfig": {"prefillChunkTokens": -1}}})

    def steps(cfg, prompts: list[int]) -> list[list[int]]:
        eng = Engine(NullRunner(vocab_size=1000), cfg, 4096)
        for i, n in enumerate(prompts):
            eng.add(P.Submit(f"r{i}", "fe", [5 + i] * n, P.SamplingParams(max_new_tokens=3, ignore_eos=True)))
        out = []
        while eng.has_work():
            f = eng.launch()
            out.append(list(f.batch.num_tokens))
            eng.collect(f)
        return out

    chunked = steps(engine_cfg(96, hold=0), [100] * 4)
    prompt_tokens = [sum(n for n in s if n > 1) for s in chunked]
    assert max(prompt_tokens) == 96 and sum(prompt_tokens) == 400, chunked
    assert chunked[1].count(1) == 0 and any(s.count(1) and max(s) > 1 for s in chunked), chunked  # decodes interleave
    assert steps(engine_cfg(96), [300])[0] == [300]  # alone: the whole prompt in one step
    assert steps(engine_cfg(0), [100] * 4)[0] == [100] * 4  # 0: maxPrefillTokens


def _hold_engine(tmp_path: Path, hold, step_ms: float = 0.0, device: str = "cpu", **schedule):
    """An engine on the null model from a config with ``decodeHoldMs`` (None: absent) and 96-token
    prompt chunks; the settled EngineConfig is returned with it."""
    from workers.engine.engine import Engine
    from workers.engine.model_runner import NullRunner
    from workers.prepare import settle

    data = {"BackendConfig": {"ScheduleConfig": {
        "cacheBlockSize": 16, "maxPrefillTokens": 4096, "prefillChunkTokens": 96, **schedule,
        **({} if hold is None else {"decodeHoldMs": hold})}}}
    cfg = settle(deployment(tmp_path, data).workers[0], device, "/m").engine
    return Engine(NullRunner(vocab_size=1000, step_ms=step_ms), cfg, 4096), cfg


def _hold_steps(eng, plan: dict[int, list[int]], max_new: int = 4,
                priority: dict[int, int] | None = None) -> list[dict[str, int]]:
    """Run ``eng`` to the end; ``plan`` maps a step index to the prompt lengths submitted just
    before it (request i gets ``priority[i]``, default 5). Each step is returned as
    {request id: tokens computed}."""
    from mindie.contract import wire as P

    out: list[dict[str, int]] = []
    i = 0
    while eng.has_work() or any(k >= len(out) for k in plan):
        for n in plan.get(len(out), []):
            eng.add(P.Submit(f"r{i}", "fe", [5 + i] * n, P.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                             priority=(priority or {}).get(i, 5)))
            i += 1
        f = eng.launch()
        out.append({s.request_id: n for s, n in zip(f.batch.seqs, f.batch.num_tokens)})
        eng.collect(f)
    return out


def test_decode_hold_ms_puts_prompt_completing_steps_first(tmp_path: Path) -> None:
    """decodeHoldMs reaches the engine (null = the device's default: 400 on cpu, 0 on
    accelerators; 0 = never hold). A step that completes a prompt computes prompt tokens only
    while the running requests have waited less than it: a burst of short prompts is prefilled
    back to back, then everyone decodes. A long prompt alone leaves decodes flowing between its
    chunks; only its last chunk goes first."""
    for hold, want in ((None, 400), (0, 0), (75, 75)):
        assert _hold_engine(tmp_path, hold)[1].decode_hold_ms == want
    assert [_hold_engine(tmp_path, None, device=d)[1].decode_hold_ms for d in ("npu", "cuda")] == [0, 0]
    assert _hold_engine(tmp_path, 75, device="npu")[1].decode_hold_ms == 75
    for bad in (-1, 60001):
        with pytest.raises(ConfigError, match=r"ScheduleConfig\.decodeHoldMs"):
            load(tmp_path, {"BackendConfig": {"ScheduleConfig": {"decodeHoldMs": bad}}})
    with pytest.raises(ConfigError, match=r"ScheduleConfig\.decodeHoldMs: must be < ServerConfig\.tokenTimeout \(2 s\)"):
        load(tmp_path, {"ServerConfig": {"tokenTimeout": 2}, "BackendConfig": {"ScheduleConfig": {"decodeHoldMs": 2000}}})
    load(tmp_path, {"ServerConfig": {"tokenTimeout": 2}, "BackendConfig": {"ScheduleConfig": {"decodeHoldMs": 1999}}})

    def steps_with_decodes_and_prompts(steps):
        return [s for s in steps if 1 in s.values() and max(s.values()) > 1]

    # One request decodes (r0), then four 90-token prompts arrive (r1..r4).
    eng_held, eng_mixed = _hold_engine(tmp_path, 10_000)[0], _hold_engine(tmp_path, 0)[0]
    held = _hold_steps(eng_held, {0: [20], 2: [90] * 4}, max_new=12)
    mixed = _hold_steps(eng_mixed, {0: [20], 2: [90] * 4}, max_new=12)
    # The held step takes whole prompts beyond the 96-token chunk, up to four chunks (HOLD_CHUNKS).
    assert (eng_held.scheduler.num_decode_holds, eng_mixed.scheduler.num_decode_holds) == (1, 0)
    assert held[2] == {"r1": 90, "r2": 90, "r3": 90, "r4": 90}, held
    assert held[3] == {f"r{i}": 1 for i in range(5)}, held
    assert not steps_with_decodes_and_prompts(held), held
    assert mixed[2] == {"r0": 1, "r1": 90, "r2": 5} and len(steps_with_decodes_and_prompts(mixed)) >= 4, mixed
    assert sum(sum(s.values()) for s in held) == sum(sum(s.values()) for s in mixed)  # same work
    # A burst never holds a request of higher priority (1 before 5) than its own.
    first = _hold_steps(_hold_engine(tmp_path, 10_000)[0], {0: [20], 2: [90] * 4}, max_new=12, priority={0: 1})
    assert first[2:6] == mixed[2:6], first
    # Six prompts: four whole ones fill the held step's room (384 tokens); the 200-token one does
    # not fit what is left, and alone it holds nobody: its chunks go beside the decodes, then its
    # last chunk and the whole 90-token prompt after it go first together.
    six = _hold_steps(_hold_engine(tmp_path, 10_000)[0], {0: [20], 2: [90] * 4 + [200, 90]}, max_new=12)
    assert six[2] == {"r1": 90, "r2": 90, "r3": 90, "r4": 90}, six
    decodes = {f"r{i}": 1 for i in range(5)}
    assert six[3:6] == [{**decodes, "r5": 91}, {**decodes, "r5": 91}, {"r5": 18, "r6": 90}], six

    # A 300-token prompt arrives while r0 decodes: r0 decodes beside every chunk but the last.
    long = _hold_steps(_hold_engine(tmp_path, 10_000)[0], {0: [20], 2: [300]}, max_new=12)
    assert long[2:6] == [{"r0": 1, "r1": 95}, {"r0": 1, "r1": 95}, {"r0": 1, "r1": 95}, {"r1": 15}], long


def test_decode_hold_ms_bounds_the_wait_of_running_requests(tmp_path: Path) -> None:
    """No running request waits decodeHoldMs or more while prompts go first: with 40 ms steps and
    a 100 ms hold, r0 is held for at most three steps in a row during a burst of twelve prompts,
    yet held at least once. And a hold never stalls the engine: with the batch full (maxBatchSize
    2) the waiting prompts cannot start, so the running ones decode to the end."""
    eng, _ = _hold_engine(tmp_path, 100, step_ms=40)
    steps = _hold_steps(eng, {0: [20], 2: [90] * 12}, max_new=30)
    gaps, run = [], 0
    for s in steps[2:]:
        if "r0" in s:
            gaps.append(run)
            run = 0
        else:
            run += 1
    assert max(gaps) <= 3 and max(gaps) >= 1, (gaps, steps)
    assert eng.check_no_leaks()

    eng, _ = _hold_engine(tmp_path, 10_000, maxBatchSize=2, maxPrefillBatchSize=2)
    steps = _hold_steps(eng, {0: [20, 200], 3: [50] * 3}, max_new=6)
    assert sum(n for s in steps for r, n in s.items() if r == "r0") == 20 + 5
    assert all(sum(1 for s in steps if f"r{i}" in s) > 0 for i in range(5)), steps
    assert eng.check_no_leaks()


def _gaps(steps: list[dict[str, int]], rid: str, start: int) -> list[int]:
    """Steps in a row without ``rid`` after step ``start``, each time it is back."""
    gaps, run = [], 0
    for s in steps[start:]:
        if rid in s:
            gaps.append(run)
            run = 0
        else:
            run += 1
    return gaps


def test_decode_hold_wave_prefills_a_burst_before_decodes_resume(tmp_path: Path) -> None:
    """decodeHoldWave (default true): twelve prompts arrive together, steps take 40 ms and the hold
    is 100 ms. The burst's first requests are answered while the rest still wait; past the 100 ms
    they stay held as long as the prompts completing were queued before their first tokens, so
    every prompt is prefilled before any decode and no step mixes decodes with prompt tokens.
    With the key false the 100 ms bound alone holds: r0 waits at most three steps in a row and
    decodes share steps with the burst's chunks. The hold is bounded by maxPrefillTokens prompt
    tokens and by half the token timeout; requests that were decoding before a burst arrived are
    held by decodeHoldMs alone (test_decode_hold_ms_bounds_the_wait_of_running_requests)."""
    def mixed(steps):
        return [s for s in steps if 1 in s.values() and max(s.values()) > 1]

    burst = {0: [90] * 12}
    eng, cfg = _hold_engine(tmp_path, 100, step_ms=40)
    assert cfg.decode_hold_wave is True and cfg.token_timeout_s == 600.0
    wave = _hold_steps(eng, burst, max_new=8)
    last_prompt = max(i for i, s in enumerate(wave) if max(s.values()) > 1)
    assert all(max(s.values()) > 1 for s in wave[:last_prompt + 1]) and not mixed(wave), wave
    # held through the burst: no decode of r0 until the last prompt step (11 prompts after it,
    # whole ones of 90 tokens up to four 96-token chunks per held step)
    assert last_prompt >= 3 and max(_gaps(wave, "r0", 1)) >= last_prompt, wave
    assert eng.check_no_leaks()
    # A worker takes in the requests sent while a step computes after that step: the eleven
    # added after r0's prompt step still belong to its burst.
    late = _hold_steps(_hold_engine(tmp_path, 100, step_ms=40)[0], {0: [90], 1: [90] * 11}, max_new=8)
    late_prompt = max(i for i, s in enumerate(late) if max(s.values()) > 1)
    assert not mixed(late) and late_prompt >= 3 and max(_gaps(late, "r0", 1)) >= late_prompt - 1, late

    # twice the burst for the bounds below: twelve whole prompts fit in three held steps (120 ms)
    burst = {0: [90] * 24}
    eng, cfg = _hold_engine(tmp_path, 100, step_ms=40, decodeHoldWave=False)
    assert cfg.decode_hold_wave is False
    alone = _hold_steps(eng, burst, max_new=8)
    assert max(_gaps(alone, "r0", 1)) <= 3 and mixed(alone), alone

    # At most maxPrefillTokens prompt tokens per hold: 300 here, so r0 decodes within 5 steps.
    eng, cfg = _hold_engine(tmp_path, 100, step_ms=40)
    eng.scheduler.cfg = msgspec.structs.replace(cfg, max_prefill_tokens=300)
    capped = _hold_steps(eng, burst, max_new=8)
    assert max(_gaps(capped, "r0", 1)) <= 5 and mixed(capped), capped

    # Never past half the token timeout (from ServerConfig.tokenTimeout): 0.3 s, so 150 ms.
    eng, cfg = _hold_engine(tmp_path, 50, step_ms=40)
    eng.scheduler.cfg = msgspec.structs.replace(cfg, token_timeout_s=0.3)
    timed = _hold_steps(eng, burst, max_new=8)
    assert max(_gaps(timed, "r0", 1)) <= 5 and mixed(timed), timed
    with pytest.raises(ConfigError, match=r"ScheduleConfig\.decodeHoldWave"):
        load(tmp_path, {"BackendConfig": {"ScheduleConfig": {"decodeHoldWave": "yes"}}})
    assert schedule_config(tmp_path, {}, {}).token_timeout_s == 600.0
    assert deployment(tmp_path, {"ServerConfig": {"tokenTimeout": 30}}).workers[0].engine.token_timeout_s == 30.0


def test_overlap_steps_moves_compute_to_a_thread(tmp_path: Path) -> None:
    from workers.engine.model_runner import NullRunner
    from workers.prepare import settle

    class Where(NullRunner):
        threads: set[str]

        def execute(self, batch):
            self.threads.add(threading.current_thread().name)
            return super().execute(batch)

    seen = {}
    for value in (True, False, None):
        spec = deployment(tmp_path, {"BackendConfig": {"ScheduleConfig": {"overlapSteps": value}}}).workers[0]
        spec = settle(spec, "cpu", "/m")  # null = the device's default: off on cpu
        runner = Where()
        runner.threads = set()
        run_engine(spec.engine, distinct_prompts(3, 5), max_new=3, runner=runner)
        seen[value] = runner.threads
    main = threading.current_thread().name
    assert seen[False] == seen[None] == {main}
    assert len(seen[True]) == 1 and seen[True] != {main} and next(iter(seen[True])).startswith("engine-compute")


# -------------------------------------------------------------------------------------------------
# The model runner: dtype and watermark (the demo model, loaded as a worker loads it).
# -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tmp_path_factory, demo_model):
    """load_runner (what a CPU worker calls) on the spec of a config with dtype bfloat16 and a
    watermark of gamma 0.25, delta 7."""
    from workers.backends.cpu import CpuBackend
    from workers.engine.assembly import load_runner

    tmp = tmp_path_factory.mktemp("runner")
    spec = deployment(tmp, {"ServerConfig": {"watermarkGamma": 0.25, "watermarkDelta": 7.0},
                            "BackendConfig": {"deviceType": "cpu", "cpuThreadsPerWorker": 1, "ModelDeployConfig": {
                                "ModelConfig": [{"modelWeightPath": demo_model, "dtype": "bfloat16"}]}}}).workers[0]
    assert (spec.dtype, spec.watermark_gamma, spec.watermark_delta) == ("bfloat16", 0.25, 7.0)
    return load_runner(spec, CpuBackend(1))


def test_dtype_is_the_models_dtype(runner, demo_model) -> None:
    import torch

    assert json.loads((Path(demo_model) / "config.json").read_text())["torch_dtype"] == "float32"
    assert runner.kv_dtype == torch.bfloat16
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}


class _Row(NamedTuple):
    params: SamplingParams
    token_ids: np.ndarray
    num_output: int = 0


def test_watermark_gamma_and_delta_reach_the_sampler(runner) -> None:
    """Greedy rows with the watermark on, flat logits but for one red token 5.0 above the rest:
    delta 7 beats it, so each row takes the first token of its gamma-0.25 green list. With the
    defaults (0.5, 2.0) the red token would win; with gamma 0.5 the first 0.5-green token."""
    import torch
    from workers.engine.watermark import WatermarkConfig, WatermarkLogitsProcessor

    vocab, rows = runner.vocab_size, 24
    prev = torch.arange(100, 100 + rows)
    green = {g: WatermarkLogitsProcessor(WatermarkConfig(gamma=g)).green_mask(prev, vocab) for g in (0.25, 0.5)}
    red = (~green[0.25]).int().argmax(-1)  # first token outside the 0.25 list
    logits = torch.zeros(rows, vocab)
    logits[torch.arange(rows), red] = 5.0
    expected = green[0.25].int().argmax(-1)  # first green token: +7 over every red one
    with_half = green[0.5].int().argmax(-1)
    assert (expected != with_half).any() and (expected != red).all()  # the three outcomes differ
    got = runner.sample(logits.clone(), [_Row(SamplingParams(watermark=True), np.array([p], dtype=np.int64))
                                 for p in prev.tolist()])
    assert got.tolist() == expected.tolist()
    plain = runner.sample(logits.clone(), [_Row(SamplingParams(), np.array([p], dtype=np.int64))
                                           for p in prev.tolist()])
    assert plain.tolist() == red.tolist()  # watermark off: the red token


# -------------------------------------------------------------------------------------------------
# The real server, started once for the keys only a running server shows.
# -------------------------------------------------------------------------------------------------

FRAME_RE = re.compile(rb"data: (\{.*?\})\n\n", re.S)
HOST = "127.0.0.3"  # not the harness's 127.0.0.1: ipAddress must be what the server binds


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("keys-server")
    port = free_port()
    run_dir = short_run_dir()
    cfg = write_config(
        tmp / "config.json", port=port, run_dir=run_dir, model_path=demo_model, workers=1,
        server={"ipAddress": HOST, "fullTextEnabled": True, "tokenTimeout": 2},
        deploy={"maxSeqLen": 120, "maxInputTokenLen": 100, "truncation": 1},
        schedule={"cacheBlockSize": 32, "maxIterTimes": 50, "overlapSteps": True, "decodeHoldMs": 250},
        model={"modelName": "cfg-model", "cpuMemSize": 0.25})
    srv = Server(cfg, port, health_url=f"http://{HOST}:{port}/health")
    srv.url = f"http://{HOST}:{port}"
    srv.run_dir = run_dir
    srv.demo_model = demo_model
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def stream(srv: Server, ids: list[int], **params) -> tuple[list[dict], bytes]:
    body = {"input_id": ids, "stream": True, "parameters": {"details": True, "ignore_eos": True, **params}}
    with httpx.stream("POST", srv.url + "/infer_token", content=json.dumps(body), timeout=60) as r:
        raw = r.read()
    assert r.status_code == 200, raw[:300]
    return [json.loads(f) for f in FRAME_RE.findall(raw)], raw


def generated(frames: list[dict]) -> tuple[list[int], dict]:
    assert "generated_text" in frames[-1], frames[-1]
    return [t for f in frames for t in f["token"]["id"]], frames[-1]


def test_e2e_listens_on_ip_address_port_and_run_dir(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
    names = set(os.listdir(server.run_dir))
    assert {"deployment.json", "w0-jobs.ipc", "w0-frames.ipc"} <= names, names


def test_e2e_model_name_and_weight_path(server) -> None:
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert [(m["id"], m["root"]) for m in models["data"]] == [("cfg-model", server.demo_model)]
    assert httpx.get(server.url + "/v1/models/cfg-model", timeout=10).status_code == 200
    assert httpx.get(server.url + "/v1/models/demo", timeout=10).status_code == 404


def test_e2e_full_text_stream(server) -> None:
    """fullTextEnabled: each frame's token.text is the text so far, exactly what the incremental
    detokenizer has produced up to that token; the final frame's generated_text is the whole text."""
    from mindie.text.detokenizer import IncrementalDetokenizer, load_tokenizer

    frames, _ = stream(server, [5618, 19678, 701, 9072, 13], max_new_tokens=30)
    ids, final = generated(frames)
    assert len(ids) == 30 and final["token"]["text"] is None
    texts = [f["token"]["text"] for f in frames[:-1]]
    detok = IncrementalDetokenizer(load_tokenizer(server.demo_model))
    so_far, expected = "", []
    for f in frames[:-1]:
        so_far += detok.push(f["token"]["id"])
        expected.append(so_far)
    assert texts == expected
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(set(texts)) > 5  # the text grew along the stream (not one piece repeated)
    detok.push(final["token"]["id"])
    assert final["generated_text"] == detok.full_text() and final["generated_text"].startswith(texts[-1])


def test_e2e_output_budget(server) -> None:
    """min(max_new_tokens, maxIterTimes 50, maxSeqLen 120 - input)."""
    for n_in, want in ((3, 50), (90, 30)):
        frames, _ = stream(server, list(range(10, 10 + n_in)), max_new_tokens=500)
        ids, final = generated(frames)
        assert (len(ids), final["details"]["generated_tokens"], final["details"]["finish_reason"]) == (
            want, want, "length")


def test_e2e_truncation(server) -> None:
    """truncation 1 keeps the last maxInputTokenLen (100) tokens of a 150-token prompt: the same
    output as those 100 tokens sent alone, and the output budget of a 100-token input
    (maxSeqLen 120 - 100 = 20). Without truncation the prompt would be refused (424)."""
    prompt = [(i * 7919) % 31000 + 3 for i in range(150)]
    long_ids, final = generated(stream(server, prompt, max_new_tokens=500)[0])
    assert final["details"]["generated_tokens"] == 20
    assert generated(stream(server, prompt[-100:], max_new_tokens=500)[0])[0] == long_ids
    assert generated(stream(server, prompt[:100], max_new_tokens=500)[0])[0] != long_ids  # not the first 100


def test_e2e_worker_applies_its_keys(server) -> None:
    """The worker's own log: KV cache of cpuMemSize 0.25 GiB in 32-token blocks (cacheBlockSize), on
    one torch thread (cpuThreadsPerWorker 1), step overlap on (overlapSteps; off by default on cpu), decodes
    held up to 250 ms (decodeHoldMs)."""
    log = server.tail(1000)
    m = re.search(r"KV cache: (\d+) blocks x (\d+) tokens \(([\d.]+) GiB, (\d+) token slots\) on cpu \((\d+) threads",
                  log)
    assert m, log[-3000:]
    blocks, size, gib, slots, threads = int(m[1]), int(m[2]), float(m[3]), int(m[4]), int(m[5])
    assert (size, threads, slots) == (32, 1, blocks * 32)
    assert 0.24 <= gib <= 0.25
    assert "step overlap on" in log
    assert "prefill: chunks of 128 prompt tokens while others have work; steps that complete a prompt hold " \
           "decodes up to 250 ms" in log


def test_e2e_prompts_go_first_and_are_counted(server) -> None:
    """decodeHoldMs 250 on the real server: prompts that arrive while a stream decodes are
    prefilled first, which num_decode_holds_total on /metrics counts, and every request still gets
    its whole output."""
    def holds() -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        m = re.search(r'^num_decode_holds_total\{model_name="cfg-model"\} (\S+)$', text, re.M)
        assert m, text[-2000:]
        return float(m[1])

    before = holds()
    # sampled (seeded): the demo model's greedy text repeats itself, which speculation copies many
    # tokens a step, and the stream could end before the burst arrives; sampled, it takes ~50 steps
    body = {"input_id": [5, 6, 7], "stream": True,
            "parameters": {"max_new_tokens": 50, "ignore_eos": True, "do_sample": True, "temperature": 1.0, "seed": 3}}
    for _attempt in range(3):  # the burst must reach the worker while the stream still decodes
        burst: dict[int, list[dict]] = {}
        with httpx.stream("POST", server.url + "/infer_token", content=json.dumps(body), timeout=60) as r:
            chunks = r.iter_raw()
            head = next(chunks)  # the stream's first token: it decodes from now on
            threads = [threading.Thread(target=lambda i=i: burst.__setitem__(i, stream(server, [9 + i] * 20,
                                                                                       max_new_tokens=5)[0]))
                       for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            raw = head + b"".join(chunks)
        assert len(generated([json.loads(f) for f in FRAME_RE.findall(raw)])[0]) == 50
        assert sorted(burst) == [0, 1, 2] and all(len(generated(burst[i])[0]) == 5 for i in range(3))
        deadline = time.monotonic() + 5  # the counter travels with the worker's heartbeats
        while holds() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        if holds() > before:
            break
    assert holds() > before


def test_e2e_token_timeout(server) -> None:
    """tokenTimeout 2 s: a stream that gets no token for 2 s (its worker stopped) ends with MindIE's
    raw text. The worker is stopped for less than the front end's dead-worker limit (3 s)."""
    (worker,) = server.workers()
    body = {"input_id": [5, 6, 7], "stream": True, "parameters": {"max_new_tokens": 5}}
    os.kill(worker, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with httpx.stream("POST", server.url + "/infer_token", content=json.dumps(body), timeout=30) as r:
            raw = r.read()
        took = time.monotonic() - t0
    finally:
        os.kill(worker, signal.SIGCONT)
    assert raw == b"Engine callback timeout: server tokenTimeout", raw[:300]
    assert 1.8 <= took < 2.9, took
    # The worker is fine afterwards: the next stream completes.
    ids, final = generated(stream(server, [5, 6, 7], max_new_tokens=5)[0])
    assert final["details"]["finish_reason"] == "length" and len(ids) == 5
