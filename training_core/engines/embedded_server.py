"""The embedded rollout server: SGLang's native HTTP API in front of :class:`GenerationEngine`.

For CPU machines, tests and demos; on GPUs production uses a real SGLang fleet, and the client
cannot tell the difference (same endpoints, same JSON, same errors). See DESIGN.md §4 and the
engine's own notes in ``generation_engine.py``.

Request bodies are pydantic models that follow SGLang's request models (io_struct.py,
sampling_params.py): a malformed body is a 422 naming the field, a sampling parameter SGLang
would refuse is a 400 naming it, and SGLang's parameters that the engine does not implement are
accepted only at their defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from training_core.engines.generation_engine import GenerationEngine, Seq
from training_core.engines.weight_group import (
    DEFAULT_GROUP_NAME,
    destroy_weight_update_group,
    init_weight_update_group,
)

# -------------------------------------------------------------------------------------------
# Request models

# SGLang's other sampling parameters with their defaults (sglang/srt/sampling/sampling_params.py).
UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "stop": None, "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "custom_params": None, "stream_interval": None, "logit_bias": None, "sampling_seed": None,
}


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def problems(self) -> str | None:
        """SGLang's own checks (SamplingParams.verify), one message naming the field."""
        for key, value in (self.model_extra or {}).items():
            if key not in UNSUPPORTED_SAMPLING_DEFAULTS:
                return f"sampling_params.{key}: unknown sampling parameter"
            if value != UNSUPPORTED_SAMPLING_DEFAULTS[key]:
                return (f"sampling_params.{key}: not supported by the embedded server (only at its "
                        f"default {UNSUPPORTED_SAMPLING_DEFAULTS[key]!r}); use SGLang for it")
        if self.temperature < 0:
            return "sampling_params.temperature must be >= 0"
        if not 0 < self.top_p <= 1:
            return "sampling_params.top_p must be in (0, 1]"
        if self.top_k < 1 and self.top_k != -1:
            return "sampling_params.top_k must be -1 (disabled) or at least 1"
        if self.max_new_tokens < 0:
            return "sampling_params.max_new_tokens must be >= 0"
        return None


class GenerateReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's dataclass request ignores extras too

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool = False


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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(engine: GenerationEngine) -> FastAPI:
    app = FastAPI(title="oolong embedded rollout server (SGLang native API)")
    counter = itertools.count()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        field_name = ".".join(str(p) for p in first["loc"] if p != "body")
        return _error(422, f"{field_name}: {first['msg']}")

    async def _one(rid: str | None, input_ids: list[int], sp: SamplingParamsIn) -> dict:
        loop = asyncio.get_running_loop()
        seq = Seq(
            rid=rid or f"{uuid.uuid4().hex[:8]}-{next(counter)}",
            prompt=list(input_ids),
            max_new_tokens=min(sp.max_new_tokens, engine.context_len - len(input_ids)),
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            stop_ids=set(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
            future=loop.create_future(), loop=loop, version=engine.weight_version,
        )
        if len(input_ids) >= engine.context_len:
            # SGLang's scheduler aborts such a request at once, with no tokens and a message.
            return engine.response(seq, {
                "type": "abort", "status_code": 400, "message":
                    f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length "
                    f"({engine.context_len - 1} tokens). Use a shorter input."})
        if seq.max_new_tokens <= 0:
            return engine.response(seq, {"type": "length", "length": 0})
        engine.submit(seq)
        return await seq.future

    @app.post("/generate")
    async def generate(body: GenerateReqIn):
        if body.stream:
            return _error(400, "stream: streaming is not supported by the embedded server")
        ids = body.input_ids
        if ids is None and body.text is not None:
            ids = ([engine.tokenizer.encode(t) for t in body.text] if isinstance(body.text, list)
                   else engine.tokenizer.encode(body.text))
        if not ids:
            return _error(400, "input_ids (or text) is required and must not be empty")
        batch = isinstance(ids[0], list)
        rows = ids if batch else [ids]
        sp = body.sampling_params or SamplingParamsIn()
        params = sp if isinstance(sp, list) else [sp] * len(rows)
        if len(params) != len(rows):
            return _error(400, "sampling_params list must match the input_ids batch")
        for p in params:
            if (problem := p.problems()) is not None:
                return _error(400, problem)
        rids = body.rid if isinstance(body.rid, list) else [
            f"{body.rid}-{i}" if body.rid and batch else body.rid for i in range(len(rows))]
        out = await asyncio.gather(*[_one(r, x, p) for r, x, p in zip(rids, rows, params, strict=True)])
        # Already plain JSON types: a JSONResponse skips FastAPI's jsonable_encoder, which walked
        # every [logprob, token, None] triple in Python on the thread that shares the GIL with
        # decoding (42% of the server's request handling in a py-spy profile).
        return JSONResponse(out if batch else out[0])

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationReqIn | None = None):
        await asyncio.to_thread(engine.pause, (body or PauseGenerationReqIn()).mode)
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqIn):
        result = await asyncio.to_thread(engine.update_weights, body.model_path,
                                         body.weight_version, abort_first=body.abort_all_requests,
                                         flush_cache=body.flush_cache)
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    # ---- weights over the network (SGLang's distributed weight update) ----------------------
    groups: dict[str, Any] = {}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqIn):
        if body.group_name in groups:
            return JSONResponse({"success": False, "message": f"group {body.group_name!r} exists; "
                                 "destroy it first"}, status_code=400)
        # SGLang's backend default is nccl: a CPU engine can only speak gloo.
        backend = body.backend if engine.device.type == "cuda" else "gloo"
        try:  # blocks until every rank has joined, so off the event loop
            groups[body.group_name] = await asyncio.to_thread(
                init_weight_update_group, master_address=body.master_address,
                master_port=body.master_port, rank=body.rank_offset, world_size=body.world_size,
                group_name=body.group_name, backend=backend)
        except Exception as exc:
            return JSONResponse({"success": False, "message": f"failed to join weight update "
                                 f"group: {type(exc).__name__}: {exc}"}, status_code=400)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqIn):
        group = groups.get(body.group_name)
        if group is None:
            return JSONResponse({"success": False, "message": f"no weight update group "
                                 f"{body.group_name!r}: call /init_weights_update_group first"},
                                status_code=400)
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return _error(400, "names, dtypes and shapes must have the same length")
        if body.load_format not in (None, "flattened_bucket"):
            return _error(400, f"load_format: {body.load_format!r} is not supported here "
                               "(null: one broadcast per tensor, or 'flattened_bucket')")
        result = await asyncio.to_thread(
            engine.update_weights_from_group, group, body.names, body.dtypes, body.shapes,
            body.weight_version, flattened=body.load_format == "flattened_bucket",
            abort_first=body.abort_all_requests, flush_cache=body.flush_cache)
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupReqIn | None = None):
        name = (body or DestroyWeightsUpdateGroupReqIn()).group_name
        group = groups.pop(name, None)
        if group is None:
            return JSONResponse({"success": False, "message": f"no group {name!r}"}, status_code=400)
        await asyncio.to_thread(destroy_weight_update_group, group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/get_weights_by_name")
    @app.get("/get_weights_by_name")
    async def get_weights_by_name(body: GetWeightsByNameReqIn):
        # Read between decode steps would race the engine thread; the parameters only change
        # under the writer lock, and a tensor read here is a copy.
        params = dict(engine.model.named_parameters(remove_duplicate=False))
        if body.name not in params:
            return _error(400, f"name: no parameter {body.name!r}")
        return params[body.name].detach()[: body.truncate_size].float().cpu().tolist()

    @app.post("/flush_cache")
    async def flush_cache():
        return {"success": True}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        # SGLang's health check generates one token, so it fails while generation is paused:
        # never poll it during a weight push.
        if engine.paused:
            return Response(status_code=503)
        probe = await _one(None, [engine.tokenizer.bos_token_id or 0],
                           SamplingParamsIn(max_new_tokens=1, temperature=0.0))
        ok = probe["meta_info"]["finish_reason"]["type"] != "abort"
        return Response(status_code=200 if ok else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")  # deprecated in SGLang, still served
    async def model_info():
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": engine.model.config.model_type,
                "architectures": getattr(engine.model.config, "architectures", None)}

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated in SGLang, still served
    async def server_info():
        return {"version": "oolong-embedded", "context_length": engine.context_len, "tp_size": 1,
                **engine.stats()}

    return app


def _exit_with_parent(pid: int) -> None:
    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Oolong embedded rollout server (SGLang API)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (no orphans after a SIGKILL)")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s server %(levelname)s %(message)s")
    engine = GenerationEngine(args.model_path, device=args.device, seed=args.seed,
                              max_batch_size=args.max_batch_size, weight_version=args.weight_version)
    import uvicorn

    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
