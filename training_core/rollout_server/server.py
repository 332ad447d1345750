"""The embedded rollout server: SGLang's native HTTP API in front of :class:`GenerationEngine`.

For CPU machines, tests and demos; on GPUs production uses a real SGLang fleet, and the client
cannot tell the difference (same endpoints, same JSON, same errors). See docs/design.md §4 and the
engine's own notes in ``generation_engine.py``.

Request bodies are pydantic models that follow SGLang's request models (io_struct.py,
sampling_params.py): a malformed body is a 422 naming the field, a sampling parameter SGLang
would refuse is a 400 naming it, and SGLang's parameters that the engine does not implement are
accepted only at their defaults.
"""

from __future__ import annotations

import argparse
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
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from training_core.rollout_server import streaming
from training_core.rollout_server.engine_process import EngineProcess
from training_core.transport.weight_group import DEFAULT_GROUP_NAME

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


class AbortReqIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str


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


def create_app(engine: EngineProcess, tokenizer: Any) -> FastAPI:
    """The HTTP front end; ``engine`` runs in a process of its own (engine_process.py)."""
    app = FastAPI(title="oolong embedded rollout server (SGLang native API)")
    counter = itertools.count()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        field_name = ".".join(str(p) for p in first["loc"] if p != "body")
        return _error(422, f"{field_name}: {first['msg']}")

    def _sampling(sp: SamplingParamsIn) -> dict[str, Any]:
        return {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature,
                "top_p": sp.top_p, "top_k": sp.top_k, "stop_token_ids": sp.stop_token_ids,
                "ignore_eos": sp.ignore_eos}

    @app.post("/generate")
    async def generate(body: GenerateReqIn):
        ids = body.input_ids
        if ids is None and body.text is not None:
            ids = ([tokenizer.encode(t) for t in body.text] if isinstance(body.text, list)
                   else tokenizer.encode(body.text))
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
        rids = [r or f"{uuid.uuid4().hex[:8]}-{next(counter)}" for r in rids]
        if body.stream:  # streaming.py: events as the tokens are sampled
            if batch:
                return _error(400, "stream: one input per streamed request on the embedded server")
            return StreamingResponse(streaming.events(engine, tokenizer, rids[0], rows[0],
                                                      _sampling(params[0])),
                                     media_type="text/event-stream")
        out = await engine.generate([(r, x, _sampling(p))
                                     for r, x, p in zip(rids, rows, params, strict=True)])
        # Already plain JSON types: a JSONResponse skips FastAPI's jsonable_encoder, which walked
        # every [logprob, token, None] triple in Python (42% of the front end's request handling
        # in a py-spy profile).
        return JSONResponse(out if batch else out[0])

    async def _result(name: str, **kwargs: Any) -> JSONResponse:
        result = await engine.call(name, **kwargs)
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationReqIn | None = None):
        await engine.call("pause", mode=(body or PauseGenerationReqIn()).mode)
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation():
        await engine.call("resume")
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqIn):
        return await _result("update_weights_from_disk", path=body.model_path,
                             version=body.weight_version, abort_first=body.abort_all_requests,
                             flush_cache=body.flush_cache)

    # ---- weights over the network (SGLang's distributed weight update) ----------------------

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqIn):
        return await _result("init_weights_update_group", master_address=body.master_address,
                             master_port=body.master_port, rank=body.rank_offset,
                             world_size=body.world_size, group_name=body.group_name,
                             backend=body.backend)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqIn):
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return _error(400, "names, dtypes and shapes must have the same length")
        if body.load_format not in (None, "flattened_bucket"):
            return _error(400, f"load_format: {body.load_format!r} is not supported here "
                               "(null: one broadcast per tensor, or 'flattened_bucket')")
        return await _result(
            "update_weights_from_distributed", group_name=body.group_name, names=body.names,
            dtypes=body.dtypes, shapes=body.shapes, version=body.weight_version,
            flattened=body.load_format == "flattened_bucket",
            abort_first=body.abort_all_requests, flush_cache=body.flush_cache)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupReqIn | None = None):
        name = (body or DestroyWeightsUpdateGroupReqIn()).group_name
        return await _result("destroy_weights_update_group", group_name=name)

    @app.post("/get_weights_by_name")
    @app.get("/get_weights_by_name")
    async def get_weights_by_name(body: GetWeightsByNameReqIn):
        values = await engine.call("get_weights_by_name", name=body.name,
                                   truncate_size=body.truncate_size)
        if values is None:
            return _error(400, f"name: no parameter {body.name!r}")
        return values

    @app.post("/flush_cache")
    async def flush_cache():
        await engine.call("flush_cache")  # the prefix cache (prefix_cache.py)
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(body: AbortReqIn):
        await engine.call("abort_request", rid=body.rid)
        return {"success": True}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        # SGLang's health check generates one token, so it fails while generation is paused:
        # never poll it during a weight push.
        if (await engine.call("stats"))["paused"]:
            return Response(status_code=503)
        bos = engine.info["bos_token_id"] or 0
        probe = await engine.generate([(f"health-{next(counter)}", [bos], _sampling(
            SamplingParamsIn(max_new_tokens=1, temperature=0.0)))])
        ok = probe[0]["meta_info"]["finish_reason"]["type"] != "abort"
        return Response(status_code=200 if ok else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")  # deprecated in SGLang, still served
    async def model_info():
        stats = await engine.call("stats")
        return {"model_path": stats["model_path"], "tokenizer_path": stats["model_path"],
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": stats["weight_version"], "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": engine.info["model_type"],
                "architectures": engine.info["architectures"]}

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated in SGLang, still served
    async def server_info():
        stats = await engine.call("stats")
        stats.pop("model_path")
        return {"version": "oolong-embedded", "context_length": engine.info["context_len"],
                "tp_size": 1, **stats}

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
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights, activations and KV cache (SGLang's --dtype); the run's "
                             "model.dtype")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (no orphans after a SIGKILL)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s server %(levelname)s %(message)s")
    # Before anything starts a thread or opens a socket: the engine process is forked from here.
    engine = EngineProcess(threads=args.threads, model_path=args.model_path, device=args.device,
                           seed=args.seed, max_batch_size=args.max_batch_size,
                           weight_version=args.weight_version, dtype=args.dtype)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    import uvicorn

    from training_core.models.loading import load_tokenizer

    try:
        uvicorn.run(create_app(engine, load_tokenizer(args.model_path)), host=args.host,
                    port=args.port, log_level="warning")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
