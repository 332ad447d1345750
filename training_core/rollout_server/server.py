"""The embedded rollout server: SGLang's native HTTP API in front of :class:`GenerationEngine`.

For CPU machines, tests and demos; on GPUs production uses a real SGLang fleet, and the client
cannot tell the difference (same endpoints, same JSON, same errors). See docs/design.md §4 and the
engine's own notes in ``generation_engine.py``.

Request bodies are pydantic models that follow SGLang's request models; what ``/generate``
accepts, and how sampling parameters are normalised, is decided as the pinned release decides
(requests.py). A malformed body is a 422 naming the field.

Auth (as SGLang's ``--api-key``/``--admin-api-key`` with one key, its ``decide_request_auth``):
with ``OOLONG_SERVER_KEY`` in the environment every route but ``/health*``, ``/ready*`` and
``/metrics*`` requires ``Authorization: Bearer <key>`` (401 otherwise). ``--weights-root``: the
only folder ``/update_weights_from_disk`` may load from (the run's weights; without it, any).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from training_core.dtypes import DEFAULT_DTYPE, PRECISIONS
from training_core.rollout_server import streaming
from training_core.rollout_server.engine_process import TENSOR_ADAPTER, EngineProcess
from training_core.rollout_server.requests import (
    AbortReqIn,
    BeginWeightUpdateReqIn,
    DestroyWeightsUpdateGroupReqIn,
    GenerateReqIn,
    GetWeightsByNameReqIn,
    InitWeightsUpdateGroupReqIn,
    LoadLoRAAdapterFromTensorsReqIn,
    LoadLoRAAdapterReqIn,
    PauseGenerationReqIn,
    SamplingParamsIn,
    UnloadLoRAAdapterReqIn,
    UpdateWeightFromDiskReqIn,
    UpdateWeightsFromDistributedReqIn,
    UpdateWeightVersionReqIn,
    admit,
    max_req_input_len,
)
from training_core.transport.server_auth import server_key

OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang keeps these open for probes

def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def allowed(method: str, path: str, authorization: str | None, key: str | None) -> bool:
    """SGLang 0.5.23's decide_request_auth with api_key == admin_api_key == ``key`` (every route
    of ours is NORMAL or ADMIN_OPTIONAL there; both then need the key)."""
    if key is None or method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, key)


def create_app(engine: EngineProcess, tokenizer: Any, *, key: str | None = None,
               weights_root: str | None = None) -> FastAPI:
    """The HTTP front end; ``engine`` runs in a process of its own (engine_process.py)."""
    app = FastAPI(title="oolong embedded rollout server (SGLang native API)")
    counter = itertools.count()
    bracket = {"open": False}  # SGLang's weight-update session (begin/end_weight_update)
    root = Path(weights_root).resolve() if weights_root else None
    # [issue 49] LoRA adapters by name, in load order (SGLang's registry); the engine serves the
    # last one loaded, merged into its weights (rollout_server/lora.py says why)
    adapters: dict[str, str] = {}
    ever_loaded: set[str] = set()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if not allowed(request.method, request.url.path, request.headers.get("authorization"),
                       key):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # SGLang answers a body its models refuse with a 400 (its own handler), in this shape.
        first = exc.errors()[0]
        field_name = ".".join(str(p) for p in first["loc"] if p != "body")
        return JSONResponse({"object": "error", "message": f"{field_name}: {first['msg']}",
                             "type": "Bad Request", "param": None, "code": 400}, status_code=400)

    @app.post("/generate")
    async def generate(body: GenerateReqIn):
        if (problem := body.unsupported_fields()) is not None:
            return _error(400, problem)
        if (problem := _unknown_adapter(body.lora_path)) is not None:
            return _error(400, problem)
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
            if (problem := p.contract_error()) is not None:  # the release's gate: its shape
                return JSONResponse({"error": problem}, status_code=400)
        for p in params:
            if (problem := p.problems()) is not None:
                return _error(400, problem)
        sampling = [p.engine_params() for p in params]
        for row, sp_row in zip(rows, sampling, strict=True):
            budget = admit(len(row), sp_row["max_new_tokens"], engine.info["context_len"])
            if isinstance(budget, str):
                return _error(400, budget)
            sp_row["max_new_tokens"] = budget  # SGLang's scheduler cuts it as well
        rids = body.rid if isinstance(body.rid, list) else [
            f"{body.rid}-{i}" if body.rid and batch else body.rid for i in range(len(rows))]
        rids = [r or f"{uuid.uuid4().hex[:8]}-{next(counter)}" for r in rids]
        flag = body.return_logprob
        logprobs_asked = [bool(f) for f in flag] if isinstance(flag, list) else [bool(flag)] * len(rows)
        if len(logprobs_asked) != len(rows):
            return _error(400, "return_logprob list must match the input_ids batch")
        if body.stream:  # streaming.py: events as the tokens are sampled
            if batch:
                return _error(400, "stream: one input per streamed request on the embedded server")
            return StreamingResponse(streaming.events(engine, tokenizer, rids[0], rows[0],
                                                      sampling[0],
                                                      return_logprob=logprobs_asked[0]),
                                     media_type="text/event-stream")
        out = await engine.generate(list(zip(rids, rows, sampling, strict=True)))
        for item, asked in zip(out, logprobs_asked, strict=True):
            if not asked:  # SGLang adds them only when asked (TokenizerManager)
                item["meta_info"].pop("output_token_logprobs", None)
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
        if root is not None and not Path(body.model_path).resolve().is_relative_to(root):
            return JSONResponse({"success": False, "message": f"model_path: {body.model_path} is "
                                 f"outside this server's weights root ({root})"}, status_code=400)
        return await _result("update_weights_from_disk", path=body.model_path,
                             version=body.weight_version, abort_first=body.abort_all_requests,
                             flush_cache=body.flush_cache)

    # ---- LoRA adapters (SGLang's routes; issue 49) ------------------------------------------

    def _unknown_adapter(lora_path: str | list[str | None] | None) -> str | None:
        """SGLang's refusal of a request naming an adapter that is not loaded, in its words
        (TokenizerManager._resolve_lora_path, LoRARegistry.acquire)."""
        names = [lora_path] if isinstance(lora_path, str) else [n for n in lora_path or [] if n]
        for name in names:
            if name not in adapters:
                if name in ever_loaded:  # SGLang would reload it from its path; unloaded here
                    return (f"The following requested LoRA adapters are not loaded: {name}\n"
                            f"Loaded adapters: {adapters.keys()}.")
                return (f"Got LoRA adapter that has never been loaded: {name}\n"
                        f"All loaded adapters: {adapters.keys()}.")
        return None

    def _lora_result(ok: bool, message: str = "") -> JSONResponse:
        # SGLang's LoRAUpdateOutput: success, error_message, loaded_adapters (name -> path)
        return JSONResponse({"success": ok, "error_message": message,
                             "loaded_adapters": dict(adapters)}, status_code=200 if ok else 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterReqIn):
        if body.lora_name in adapters:
            return _lora_result(False, f"Failed to load LoRA adapter {body.lora_name} because it "
                                       "is already loaded")
        if root is not None and not Path(body.lora_path).resolve().is_relative_to(root):
            return _lora_result(False, f"lora_path: {body.lora_path} is outside this server's "
                                       f"weights root ({root})")
        result = await engine.call("apply_adapter", path=body.lora_path)
        if not result["success"]:
            return _lora_result(False, result["message"])
        adapters[body.lora_name] = body.lora_path
        ever_loaded.add(body.lora_name)
        return _lora_result(True)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(body: LoadLoRAAdapterFromTensorsReqIn):
        """An adapter whose tensors came over the weight update group (weight_sync
        distributed): ``serialized_named_tensors`` is empty here. SGLang's payloads are pickles
        of tensors shared between processes of one machine, which a server must not unpickle
        from the network; the weight group carries the bytes instead."""
        if body.serialized_named_tensors:
            return _lora_result(False, "serialized_named_tensors: the embedded server takes an "
                                       "adapter's tensors over the weight update group only "
                                       "(/update_weights_from_distributed, then this route "
                                       "with an empty list)")
        if body.lora_name in adapters:
            return _lora_result(False, f"Failed to load LoRA adapter {body.lora_name} because it "
                                       "is already loaded")
        result = await engine.call("load_received_adapter", name=body.lora_name,
                                   config=body.config_dict)
        if not result["success"]:
            return _lora_result(False, result["message"])
        adapters[body.lora_name] = TENSOR_ADAPTER
        ever_loaded.add(body.lora_name)
        return _lora_result(True)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterReqIn):
        if body.lora_name not in adapters:
            return _lora_result(False, f"LoRA with name {body.lora_name} does not exist. Loaded "
                                       f"LoRAs: {adapters.keys()}")
        was_serving = body.lora_name == next(reversed(adapters))
        del adapters[body.lora_name]
        if was_serving:  # the newest adapter left serves, or the base
            newest = next(reversed(adapters)) if adapters else None
            result = await engine.call("apply_adapter", path=adapters.get(newest), name=newest)
            if not result["success"]:
                return _lora_result(False, result["message"])
        await engine.call("forget_adapter", name=body.lora_name)
        return _lora_result(True)

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionReqIn):
        result = await engine.call("set_weight_version", version=body.new_version,
                                   abort_first=body.abort_all_requests)
        if not result["success"]:
            return JSONResponse({"success": False, "message": result["message"]}, status_code=400)
        return {"success": True, "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version}

    # ---- weights over the network (SGLang's distributed weight update) ----------------------

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqIn):
        return await _result("init_weights_update_group", master_address=body.master_address,
                             master_port=body.master_port, rank=body.rank_offset,
                             world_size=body.world_size, group_name=body.group_name,
                             backend=body.backend)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqIn):
        if not bracket["open"]:  # 0.5.23 loads distributed weights only inside a session
            return JSONResponse({"success": False, "message": "update_weights_from_distributed "
                                 "must run between begin_weight_update() and end_weight_update()"},
                                status_code=400)
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

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # SGLang flushes only when nothing runs or waits (waiting requests do not count while
        # generation is paused), and answers in plain text.
        stats = await engine.call("stats")
        if stats["running"] or (stats["waiting"] and not stats["paused"]):
            return Response("Flush cache failed.\n", status_code=400)
        await engine.call("flush_cache")  # the prefix cache (prefix_cache.py)
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there "
                        "are running or waiting requests, the operation will not be performed.)\n")

    @app.post("/abort_request")
    async def abort_request(body: AbortReqIn):
        await engine.call("abort_request", rid=body.rid)
        return {"success": True}

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: BeginWeightUpdateReqIn | None = None):
        if bracket["open"]:
            return JSONResponse({"success": False, "message": "a weight-update session is already "
                                 "open; call end_weight_update() first"}, status_code=400)
        bracket["open"] = True
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update")
    async def end_weight_update():
        if not bracket["open"]:
            return JSONResponse({"success": False, "message": "no weight-update session is open; "
                                 "call begin_weight_update() first"}, status_code=400)
        bracket["open"] = False
        return {"success": True, "message": "Success"}

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        # SGLang's health check generates one token, so it fails while generation is paused:
        # never poll it during a weight push.
        if (await engine.call("stats"))["paused"]:
            return Response(status_code=503)
        bos = engine.info["bos_token_id"] or 0
        probe = await engine.generate([(f"health-{next(counter)}", [bos], SamplingParamsIn(
            max_new_tokens=1, temperature=0.0).engine_params())])
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
                "max_req_input_len": max_req_input_len(engine.info["context_len"]),
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


def build_parser() -> argparse.ArgumentParser:
    """The server's flags; what a run passes is ``launch.embedded_server_command``'s (tests check
    that every flag it writes parses here)."""
    parser = argparse.ArgumentParser(description="Oolong embedded rollout server (SGLang API)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, choices=list(PRECISIONS),
                        help="weights, activations and KV cache (SGLang's --dtype); the run's "
                             "model.dtype")
    parser.add_argument("--weights-root", default=None,
                        help="the only folder /update_weights_from_disk may load from (the "
                             "run's weights/); default: any")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (no orphans after a SIGKILL)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
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
        app = create_app(engine, load_tokenizer(args.model_path),
                         key=server_key(), weights_root=args.weights_root)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
