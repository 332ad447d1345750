"""The pinned SGLang release's own code, executed here as the oracle for the embedded server.

SGLang cannot run on these machines (CUDA only), but the rules the embedded server must follow
are plain Python in its wheel: the HTTP contract gate (``sglang/api/v1/api_types.py``), the
sampling parameters' normalisation and checks (``srt/sampling/sampling_params.py``), the length
check (``TokenizerManager._validate_one_request``), the auth decision (``srt/utils/auth.py``) and
the per-token weight-version spans (``srt/utils/weight_versions.py``). Each is loaded from the
release's source (``sglang_contract.release_source``: the wheel ``scripts/test.sh`` fetches) by
file, with stand-ins only for the few imports that would pull in torch or CUDA, and called as
SGLang calls it."""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
import types
from functools import cache
from pathlib import Path
from typing import Any

import msgspec


def _load(root: Path, relative: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, root / "sglang" / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _stub(name: str, **attrs: Any) -> None:
    """A stand-in module for an import the loaded file makes (only where the real one would pull
    in torch or the rest of SGLang)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


class Release:
    def __init__(self, root: Path):
        self.root = root
        self.api = _load(root, "api/v1/api_types.py", "sglang_oracle_api_types")

        class Watermark(msgspec.Struct):  # the release's own is a plain struct; none is used
            pass

        saved = {k: sys.modules.get(k) for k in ("sglang", "sglang.srt", "sglang.srt.sampling",
                                                  "sglang.srt.sampling.watermarking",
                                                  "sglang.srt.sampling.watermarking.core",
                                                  "sglang.srt.utils",
                                                  "sglang.srt.utils.msgspec_utils")}
        try:
            _stub("sglang.srt.sampling.watermarking.core", WatermarkRequestConfig=Watermark,
                  normalize_watermark_request=lambda w: w)
            _stub("sglang.srt.utils.msgspec_utils",
                  msgspec_struct_pydantic_core_schema=lambda cls, handler: None)
            self.sampling = _load(root, "srt/sampling/sampling_params.py", "sglang_oracle_sampling")
            self.versions = _load(root, "srt/utils/weight_versions.py", "sglang_oracle_versions")
        finally:
            _restore_modules(saved)
        self.auth = _load(root, "srt/utils/auth.py", "sglang_oracle_auth")

    # ---- the rules, as SGLang applies them ---------------------------------------------------

    def contract_error(self, body: Any) -> str | None:
        """``api_contract.generate_contract_error``: the gate every /generate body passes."""
        try:
            self.api.GenerateRequest.from_json_value(body)
        except self.api.JsonContractError as exc:
            return str(exc)
        return None

    def sampling_params(self, **params: Any) -> Any:
        """``SamplingParams(**params)`` after its ``__post_init__``; ``verify`` raises
        ValueError with SGLang's message."""
        sp = self.sampling.SamplingParams(**params)
        sp.verify(vocab_size=1 << 20)
        return sp

    def admitted(self, prompt_tokens: int, max_new_tokens: int, context_len: int) -> int | str:
        """What SGLang runs a request with, or its refusal: the tokenizer manager's length
        check, then the scheduler's (``validate_input_length``, then
        ``Scheduler.init_req_max_new_tokens``), each its own code, on a server whose context is
        ``context_len`` and whose KV pool is larger (max_req_input_len = context - 6)."""
        refused = self.length_error(prompt_tokens, max_new_tokens, context_len)
        if refused is not None:
            return refused
        max_req_len = context_len - 1
        req = types.SimpleNamespace(
            origin_input_ids=list(range(prompt_tokens)), rid="r",
            sampling_params=types.SimpleNamespace(max_new_tokens=max_new_tokens, min_new_tokens=0))
        logger = types.SimpleNamespace(warning=print, error=print)
        validate = _compiled(self.root, "srt/managers/utils.py", "validate_input_length",
                             {"logger": logger, "Req": Any, "Optional": Any})
        error = validate(req, max_req_len - 5, False)
        if error:
            return error
        pool = types.SimpleNamespace(max_new_tokens_for_memory=lambda n, m, **kw: m)
        scheduler = types.SimpleNamespace(
            max_new_tokens_limit=None, max_req_len=max_req_len, max_total_num_tokens=1 << 40,
            kv_shard_widening=1, page_size=1, token_to_kv_pool_allocator=pool,
            sliding_window_size=None, chunked_prefill_size=None)
        init = _compiled(self.root, "srt/managers/scheduler.py", "init_req_max_new_tokens",
                         {"logger": logger})
        init(scheduler, req)
        return req.sampling_params.max_new_tokens

    def length_error(self, prompt_tokens: int, max_new_tokens: int | None,
                     context_len: int) -> str | None:
        """``TokenizerManager._validate_one_request``'s length checks, its own code, on a
        manager whose context is ``context_len`` (auto-truncation off, its default)."""
        fn = _validate_one_request(self.root)
        manager = types.SimpleNamespace(
            context_len=context_len, num_reserved_tokens=0, allow_auto_truncate=False,
            validate_total_tokens=True, _validate_joint_schema_request=lambda obj, ids: None)
        obj = types.SimpleNamespace(image_data=None, sampling_params={"max_new_tokens": max_new_tokens})
        try:
            fn(manager, obj, list(range(prompt_tokens)))
        except ValueError as exc:
            return str(exc)
        except _PastTheLengthChecks:
            return None
        return None

    def allowed(self, method: str, path: str, authorization: str | None, key: str | None,
                level: str) -> bool:
        decision = self.auth.decide_request_auth(
            method=method, path=path, authorization_header=authorization, api_key=key,
            admin_api_key=key, auth_level=self.auth.AuthLevel(level))
        return decision.allowed

    def version_meta(self, events: list[tuple[str, int]], current: str, tokens: int) -> dict:
        recorded = [self.versions.WeightVersionEvent(old_version=v, num_output_tokens=n)
                    for v, n in events]
        spans = self.versions.compute_weight_version_spans(recorded, current, tokens)
        meta: dict = {}
        self.versions.add_weight_versions_to_meta_info(meta, spans, tokens)
        return meta


class _PastTheLengthChecks(Exception):
    """Raised by the stand-ins the checks after the length checks reach: the request fit."""


def _compiled(root: Path, relative: str, name: str, namespace: dict[str, Any]):
    """Function ``name`` of the release's file, its own source compiled alone, with
    ``namespace`` standing in for the module's other names (the module itself imports CUDA)."""
    source = (root / "sglang" / relative).read_text()
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name)
    code = textwrap.dedent(ast.get_source_segment(source, node))
    scope = dict(namespace)
    exec(compile("from __future__ import annotations\n" + code, relative, "exec"), scope)
    return scope[name]


@cache
def _validate_one_request(root: Path):
    """The method's own source, compiled with stand-ins for the names it reads besides the
    manager (the execution-feature flags; the request classes after the length checks)."""

    class Past:
        def __instancecheck__(self, obj):
            raise _PastTheLengthChecks

    features = types.SimpleNamespace(features=types.SimpleNamespace(
        enable_encoder_swa_bounded_replay=False))
    namespace = {"get_exec": lambda: features, "logger": types.SimpleNamespace(warning=print),
                 "GenerateReqInput": Past(), "EmbeddingReqInput": Past(),
                 "Union": Any, "List": list, "Optional": Any}
    return _compiled(root, "srt/managers/tokenizer_manager.py", "_validate_one_request", namespace)


def lora_parser(root: Path) -> tuple[Any, list[str]]:
    """The release's own argparse for its LoRA server arguments (``fields/lora.py`` through its
    ``add_cli_args_from_dataclass``), and its ``SUPPORTED_LORA_TARGET_MODULES``. Stand-ins only
    for the two names it imports from modules that pull in torch (the adapter registry's
    ``LoRARef``; the module list is read from the release's ``utils/common.py`` by value)."""
    import argparse

    common = (root / "sglang/srt/utils/common.py").read_text()
    values = {}
    for node in ast.parse(common).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("SUPPORTED_LORA_TARGET_MODULES", "LORA_TARGET_ALL_MODULES"):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    names = ("sglang", "sglang.srt", "sglang.srt.arg_groups", "sglang.srt.arg_groups.arg_utils",
             "sglang.srt.arg_groups.argparse_actions", "sglang.srt.lora",
             "sglang.srt.lora.lora_registry", "sglang.srt.utils", "sglang.srt.utils.common")
    saved = {k: sys.modules.get(k) for k in names}
    try:
        arg_utils = _load(root, "srt/arg_groups/arg_utils.py", "sglang.srt.arg_groups.arg_utils")
        _load(root, "srt/arg_groups/argparse_actions.py", "sglang.srt.arg_groups.argparse_actions")
        _stub("sglang.srt.lora.lora_registry", LoRARef=type("LoRARef", (), {}))
        _stub("sglang.srt.utils.common", **values)
        fields = _load(root, "srt/arg_groups/fields/lora.py", "sglang_oracle_lora_fields")
        parser = argparse.ArgumentParser(exit_on_error=False)
        arg_utils.add_cli_args_from_dataclass(parser, fields.Lora)
    finally:
        _restore_modules(saved)
    return parser, values["SUPPORTED_LORA_TARGET_MODULES"]


def _restore_modules(saved: dict) -> None:
    """Put ``sys.modules`` back as it was before the oracle's stubs and loads."""
    for key, value in saved.items():
        if value is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = value
