"""What the embedded server accepts on ``/generate``, decided as the pinned SGLang 0.5.23 decides.

The embedded server stands in for SGLang on CPU machines: where the two answer the same request
differently, the CPU tests train on data production never sees. Each rule below names where
SGLang has it (the wheel is the oracle: tests/training_core/rollout_server/test_sglang_parity.py executes the
release's own code against these functions):

- the HTTP contract gate (``sglang/api/v1/api_types.py``): unknown top-level keys are ignored,
  unknown sampling parameters refused;
- SGLang's request fields the embedded server does not implement are refused at any value but
  their default, naming them (accepting and ignoring ``logprob_start_len`` would answer with
  other logprobs than asked); ``lora_path`` names a loaded adapter (issue 49, server.py);
- ``SamplingParams.__post_init__`` and ``verify`` (``srt/sampling/sampling_params.py``):
  ``0 <= temperature < 1e-6`` is greedy (SGLang sets temperature 1 and top_k 1), ``top_k`` -1 or
  SGLang's TOP_K_ALL is the whole vocabulary, and the range checks with SGLang's own messages;
- the length checks: the tokenizer manager's (``_validate_one_request``, auto-truncation off: a
  prompt at or over the context, or prompt + ``max_new_tokens`` over it, a 400) then the
  scheduler's (``validate_input_length``: a prompt at or over ``max_req_input_len`` = context - 6,
  a 400; ``init_req_max_new_tokens``: ``max_new_tokens`` cut to context - 2 - prompt), with
  SGLang's words; the prompt is never trimmed.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from training_core.transport.weight_group import DEFAULT_GROUP_NAME

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it is greedy
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (what -1 becomes)

# SGLang's sampling fields, in its order (api_types.SamplingParams: the contract gate names them
# so when it refuses an unknown one).
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
# The other sampling parameters with their defaults: accepted at these values only.
UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "stop": None, "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "custom_params": None, "stream_interval": None, "logit_bias": {}, "sampling_seed": None,
    "beam_width": None, "watermark": None, "choice": [],
}
# SGLang's /generate fields (api_types.GenerateRequest) that change what is generated or
# returned, which the embedded server does not implement: refused unless at their default.
UNSUPPORTED_GENERATE_DEFAULTS: dict[str, Any] = {
    "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
    "return_hidden_states": None, "return_text_in_logprobs": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "routed_dp_rank": None, "disagg_prefill_dp_rank": None,
    "image_data": None, "mm_hashes": None, "video_data": None, "audio_data": None,
    "require_reasoning": None, "session_params": None, "kv_hints": None,
    "max_thinking_tokens": None, "session_id": None, "custom_logit_processor": None,
    "images_config": None, "return_prompt_token_ids": False, "routed_experts_start_len": 0,
    "return_sampling_mask": None, "modalities": None,
}
# SGLang's fields that only route, label or isolate a request: nothing to do without a cache
# shared between tenants or a router, so accepted at any value.
IGNORED_GENERATE_FIELDS = frozenset({"routing_key", "extra_key", "cache_salt", "priority",
                                     "custom_labels"})


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    max_new_tokens: int | None = 128
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False

    def contract_error(self) -> str | None:
        """The release's contract gate on these parameters: an unknown key, in its words."""
        for key in self.model_extra or {}:
            if key not in UNSUPPORTED_SAMPLING_DEFAULTS:
                expected = ", ".join(f"`{f}`" for f in SGLANG_SAMPLING_FIELDS)
                return f"unknown field `{key}`, expected one of {expected}"
        return None

    def problems(self) -> str | None:
        """The first of SGLang's refusals of these parameters (after the contract gate), in its
        own words (they name the field); None when SGLang would take them."""
        for key, value in (self.model_extra or {}).items():
            if value != UNSUPPORTED_SAMPLING_DEFAULTS[key] and value is not None:
                return (f"sampling_params.{key}: not supported by the embedded server (only at "
                        f"its default {UNSUPPORTED_SAMPLING_DEFAULTS[key]!r}); use SGLang for it")
        t = 1.0 if self.temperature is None else self.temperature
        if not math.isfinite(t) or t < 0.0:
            return f"temperature must be a non-negative finite number, got {t}."
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0.0 < top_p <= 1.0:
            return f"top_p must be in (0, 1], got {top_p}."
        if self.top_k is not None and self.top_k < 1 and self.top_k != -1:
            return f"top_k must be -1 (disable) or at least 1, got {self.top_k}."
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            return f"max_new_tokens must be at least 0, got {self.max_new_tokens}."
        return None

    def engine_params(self) -> dict[str, Any]:
        """What the engine samples with, after SGLang's normalisation: a temperature below
        SAMPLING_EPS is greedy (the engine's temperature 0: the first maximum, its logprob at
        T = 1, what SGLang's temperature 1 with top_k 1 gives); -1 and TOP_K_ALL are no top-k."""
        t = 1.0 if self.temperature is None else self.temperature
        top_k = -1 if self.top_k is None or self.top_k >= TOP_K_ALL else self.top_k
        return {"max_new_tokens": 128 if self.max_new_tokens is None else self.max_new_tokens,
                "temperature": 0.0 if t < SAMPLING_EPS else t,
                "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": top_k,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": bool(self.ignore_eos)}


class GenerateReqIn(BaseModel):
    # SGLang's contract gate ignores keys it does not know; the ones it knows and the embedded
    # server does not implement are refused (unsupported_fields).
    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool | None = False
    # [issue 49] a loaded adapter's name (one for all rows, or one per row): server.py
    lora_path: str | list[str | None] | None = None

    def unsupported_fields(self) -> str | None:
        named = [key for key, value in (self.model_extra or {}).items()
                 if key in UNSUPPORTED_GENERATE_DEFAULTS
                 and value != UNSUPPORTED_GENERATE_DEFAULTS[key]]
        if not named:
            return None
        return (f"{', '.join(named)}: not supported by the embedded server (SGLang takes "
                f"{'it' if len(named) == 1 else 'them'}; here {'it' if len(named) == 1 else 'they'} "
                "would be ignored and the answer would not be what was asked)")


def max_req_input_len(context_len: int) -> int:
    """SGLang's scheduler bound on a prompt (tp_worker: ``min(context - 1, kv pool - 1) - 5``;
    the embedded server's cache grows as needed, so the context decides). /server_info reports
    it, and the client's length rule reads it."""
    return context_len - 1 - 5


def admit(prompt_tokens: int, max_new_tokens: int | None, context_len: int) -> int | str:
    """The ``max_new_tokens`` a request runs with, or SGLang's refusal (a 400) in its words."""
    problem = context_problem(prompt_tokens, max_new_tokens, context_len)
    if problem is not None:
        return problem
    limit = max_req_input_len(context_len)
    if prompt_tokens >= limit:
        return (f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
                f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate.")
    wanted = (1 << 30) if max_new_tokens is None else max_new_tokens
    return max(0, min(wanted, context_len - 1 - prompt_tokens - 1))


def context_problem(prompt_tokens: int, max_new_tokens: int | None, context_len: int) -> str | None:
    """SGLang 0.5.23's tokenizer-manager length check (TokenizerManager._validate_one_request,
    auto-truncation off, its default), with its own words; None when the request fits."""
    if prompt_tokens >= context_len:
        return (f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({context_len} tokens).")
    if max_new_tokens is not None and max_new_tokens + prompt_tokens > context_len:
        return (f"Requested token count exceeds the model's maximum context length of "
                f"{context_len} tokens. You requested a total of {max_new_tokens + prompt_tokens} "
                f"tokens: {prompt_tokens} tokens from the input messages and {max_new_tokens} "
                "tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.")
    return None


class PauseGenerationReqIn(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightFromDiskReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitWeightsUpdateGroupReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    group_name: str = DEFAULT_GROUP_NAME


class GetWeightsByNameReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    truncate_size: int = 100


class BeginWeightUpdateReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    selector: Literal["target", "draft", "all"] = "all"


class AbortReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str


class LoadLoRAAdapterReqIn(BaseModel):
    """SGLang's LoadLoRAAdapterReqInput (io_struct.py)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class LoadLoRAAdapterFromTensorsReqIn(BaseModel):
    """SGLang's LoadLoRAAdapterFromTensorsReqInput (io_struct.py). The embedded server takes
    the tensors over the weight update group only (``serialized_named_tensors`` empty: SGLang's
    payloads are pickles for processes on its own machine, server.py)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    lora_id: str | None = None
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class UnloadLoRAAdapterReqIn(BaseModel):
    """SGLang's UnloadLoRAAdapterReqInput (io_struct.py)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_id: str | None = None


class UpdateWeightVersionReqIn(BaseModel):
    """SGLang's UpdateWeightVersionReqInput (io_struct.py)."""

    model_config = ConfigDict(extra="ignore")

    new_version: str
    abort_all_requests: bool = True
