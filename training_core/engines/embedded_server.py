"""The embedded rollout server: SGLang's native HTTP API on top of transformers.

For CPU machines, tests and demos; on GPUs production uses a real SGLang fleet, and the client
cannot tell the difference (same endpoints, same JSON). See DESIGN.md §4.

Engine (one thread, owns the model):
- Continuous batching. The running batch shares one left-padded KV cache. New requests are
  prefilled on their own and spliced into the batch between decode steps (their cache is
  left-padded to the batch's length), so joining never recomputes the running sequences.
  Finished rows leave the cache by index selection; left padding everyone has is trimmed.
- ``pause_generation`` takes effect between decode steps: every request in flight or waiting
  returns what it has with finish reason ``abort``; requests that arrive while paused wait for
  ``continue_generation``.
- ``update_weights_from_disk`` swaps weights between decode steps. Rows still running (only if
  the caller did not pause first) are re-prefilled so no KV entry mixes two weight versions.

Logprobs are those of the temperature-scaled distribution before top-k/top-p truncation, which is
what the trainer recomputes (it divides logits by the same temperature).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from transformers import DynamicCache

log = logging.getLogger("oolong.server")


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: set[int]
    ignore_eos: bool
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    arrived: float = field(default_factory=time.perf_counter)
    version: str = "0"

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class GenerationEngine:
    def __init__(self, model_path: str, *, device: str = "cpu", max_batch_size: int = 256,
                 seed: int = 0, weight_version: str = "0"):
        from training_core.models.loading import load_model, load_tokenizer

        self.model_path = model_path
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_model(model_path).to(self.device).eval()
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = weight_version

        self._cond = threading.Condition()
        self._waiting: list[_Seq] = []
        self._active: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 where a real token sits in the cache
        self._next_pos: torch.Tensor | None = None  # [B] position of each row's next token
        self._last: torch.Tensor | None = None  # [B] last sampled token, fed at the next step
        self._paused = False
        self._pause_requests: list[threading.Event] = []
        self._weight_requests: list[tuple[str, str | None, threading.Event, dict]] = []
        self._stop = False
        self.tokens_generated = 0
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _eos_ids(self) -> set[int]:
        ids = set()
        eos = self.model.generation_config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- called from the HTTP side -----------------------------------------------------------

    def submit(self, seq: _Seq) -> None:
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify()

    def pause(self) -> None:
        done = threading.Event()
        with self._cond:
            self._paused = True
            self._pause_requests.append(done)
            self._cond.notify()
        done.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def update_weights(self, path: str, version: str | None) -> dict:
        done, result = threading.Event(), {}
        with self._cond:
            self._weight_requests.append((path, version, done, result))
            self._cond.notify()
        done.wait()
        return result

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"running": len(self._active), "waiting": len(self._waiting),
                    "paused": self._paused, "tokens_generated": self.tokens_generated,
                    "steps": self.steps, "weight_version": self.weight_version}

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not self._has_work():
                    self._cond.wait()
                if self._stop:
                    self._abort_all()
                    return
                pause_acks, self._pause_requests = self._pause_requests, []
                weight_reqs, self._weight_requests = self._weight_requests, []
                joining: list[_Seq] = []
                if not self._paused:
                    room = self.max_batch_size - len(self._active)
                    joining, self._waiting = self._waiting[:room], self._waiting[room:]
            try:
                if pause_acks:
                    self._abort_all()
                    for ev in pause_acks:
                        ev.set()
                for path, version, ev, result in weight_reqs:
                    result.update(self._load_weights(path, version))
                    ev.set()
                if joining:
                    self._join(joining)
                if self._active and not self._paused:
                    self._decode_step()
            except Exception as exc:  # keep serving; fail only the requests in this batch
                log.exception("engine step failed")
                self._fail_active(exc)

    def _has_work(self) -> bool:
        return bool(
            self._pause_requests or self._weight_requests
            or (not self._paused and (self._active or self._waiting))
        )

    def _finish(self, seq: _Seq, reason: str) -> None:
        payload = {
            "text": self.tokenizer.decode(seq.output, skip_special_tokens=True),
            "output_ids": list(seq.output),
            "meta_info": {
                "id": seq.rid,
                "finish_reason": {"type": reason},
                "prompt_tokens": len(seq.prompt),
                "completion_tokens": len(seq.output),
                "output_token_logprobs": [
                    [lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output, strict=True)
                ],
                "weight_version": seq.version,
                "e2e_latency": time.perf_counter() - seq.arrived,
            },
        }
        seq.loop.call_soon_threadsafe(_set_result, seq.future, payload)

    def _abort_all(self) -> None:
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for seq in self._active + waiting:
            self._finish(seq, "abort")
        self._reset_batch()

    def _fail_active(self, exc: Exception) -> None:
        for seq in self._active:
            seq.loop.call_soon_threadsafe(_set_exception, seq.future, exc)
        self._reset_batch()

    def _reset_batch(self) -> None:
        self._active, self._cache, self._mask, self._next_pos, self._last = [], None, None, None, None

    def _load_weights(self, path: str, version: str | None) -> dict:
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"no *.safetensors in {path}"}
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f), device=str(self.device)))
        own = self.model.state_dict()
        unexpected = [k for k in state if k not in own]
        if unexpected:
            return {"success": False, "message": f"unexpected tensors {unexpected[:5]}"}
        mismatched = [k for k, v in state.items() if v.shape != own[k].shape]
        if mismatched:
            return {"success": False, "message": f"shape mismatch for {mismatched[:5]}"}
        self.model.load_state_dict(state, strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self.weight_version = version if version is not None else self.weight_version
        self.model_path = path
        # Rows still running hold KV from the old weights: recompute them with the new ones.
        if self._active:
            rows = self._active
            self._reset_batch()
            self._join(rows)
        return {"success": True, "message": f"loaded {len(state)} tensors from {path}",
                "num_paused_requests": 0}

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :].float()

    def _join(self, seqs: list[_Seq]) -> None:
        """Prefill ``seqs`` (left-padded together) and splice them into the running batch."""
        for s in seqs:
            s.version = self.weight_version
        length = max(len(s.tokens) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, s in enumerate(seqs):
            toks = s.tokens
            ids[i, length - len(toks):] = torch.tensor(toks)
            mask[i, length - len(toks):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, mask, pos, cache)
        next_pos = mask.sum(-1)
        if self._cache is None:
            self._cache, self._mask, self._next_pos = cache, mask, next_pos
            self._active = list(seqs)
        else:
            self._cache, self._mask = _merge_caches(self._cache, self._mask, cache, mask)
            self._next_pos = torch.cat([self._next_pos, next_pos])
            self._active = self._active + list(seqs)
        self._sample_and_advance(logits, rows=range(len(self._active) - len(seqs), len(self._active)))

    def _decode_step(self) -> None:
        if self._last is None:  # every row already has its next token sampled
            return
        ids = self._last.view(-1, 1)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        logits = self._forward(ids, self._mask, self._next_pos.view(-1, 1), self._cache)
        self._next_pos = self._next_pos + 1
        self._sample_and_advance(logits, rows=range(len(self._active)))

    def _sample_and_advance(self, logits: torch.Tensor, rows: range) -> None:
        """Sample one token for each row in ``rows`` (logits has one line per row in ``rows``)."""
        seqs = [self._active[i] for i in rows]
        tokens, logprobs = _sample(logits, seqs, self.generator)
        self.steps += 1
        self.tokens_generated += len(seqs)
        for s, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            s.output.append(tok)
            s.logprobs.append(lp)
        # Tokens to feed at the next decode step: previous last tokens for the rows not sampled.
        if self._last is None or len(self._last) != len(self._active):
            last = torch.zeros(len(self._active), dtype=torch.long, device=self.device)
            if self._last is not None:
                last[: len(self._last)] = self._last
        else:
            last = self._last.clone()
        last[rows.start:rows.stop] = tokens
        self._last = last
        # Retire finished rows.
        keep = []
        for i, s in enumerate(self._active):
            tok = s.output[-1]
            if (tok in self.eos_ids and not s.ignore_eos) or tok in s.stop_ids:
                self._finish(s, "stop")
            elif len(s.output) >= s.max_new_tokens:
                self._finish(s, "length")
            else:
                keep.append(i)
        if len(keep) != len(self._active):
            if not keep:
                self._reset_batch()
                return
            idx = torch.tensor(keep, device=self.device)
            self._active = [self._active[i] for i in keep]
            self._cache.batch_select_indices(idx)
            self._mask, self._next_pos, self._last = self._mask[idx], self._next_pos[idx], self._last[idx]
            self._trim_left_padding()

    def _trim_left_padding(self) -> None:
        lead = int((self._mask.cumsum(-1) == 0).sum(-1).min())
        if lead > 0:
            self._mask = self._mask[:, lead:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, lead:, :]
                layer.values = layer.values[:, :, lead:, :]


def _merge_caches(a: DynamicCache, a_mask: torch.Tensor, b: DynamicCache, b_mask: torch.Tensor):
    """Concatenate two left-padded caches along the batch, left-padding the shorter one."""
    la, lb = a_mask.shape[1], b_mask.shape[1]
    length = max(la, lb)

    def pad(t: torch.Tensor, n: int) -> torch.Tensor:  # [B, H, L, D] -> left-pad L by n
        return t if n == 0 else torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2)

    layers = []
    for la_, lb_ in zip(a.layers, b.layers, strict=True):
        keys = torch.cat([pad(la_.keys, length - la), pad(lb_.keys, length - lb)], dim=0)
        values = torch.cat([pad(la_.values, length - la), pad(lb_.values, length - lb)], dim=0)
        layers.append((keys, values))
    mask = torch.cat([
        torch.cat([a_mask.new_zeros(a_mask.shape[0], length - la), a_mask], dim=1),
        torch.cat([b_mask.new_zeros(b_mask.shape[0], length - lb), b_mask], dim=1),
    ])
    return DynamicCache(ddp_cache_data=layers), mask


def _sample(logits: torch.Tensor, seqs: list[_Seq], gen: torch.Generator):
    temps = torch.tensor([s.temperature for s in seqs], device=logits.device).view(-1, 1)
    greedy = temps.view(-1) <= 0
    scaled = logits / torch.where(greedy.view(-1, 1), torch.ones_like(temps), temps)
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled.clone()
    for i, s in enumerate(seqs):
        if s.top_k > 0 and s.top_k < filtered.shape[-1]:
            kth = torch.topk(filtered[i], s.top_k).values[-1]
            filtered[i][filtered[i] < kth] = float("-inf")
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(filtered[i], descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) > s.top_p
            filtered[i][order[drop]] = float("-inf")
    probs = torch.softmax(filtered, dim=-1)
    sampled = torch.multinomial(probs, 1, generator=gen).view(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens.view(-1, 1)).view(-1)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)


# -------------------------------------------------------------------------------------------
# HTTP: SGLang's native endpoints


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(engine: GenerationEngine) -> FastAPI:
    app = FastAPI(title="oolong embedded rollout server (SGLang native API)")
    counter = itertools.count()

    async def _one(body: dict, input_ids: list[int], sp: dict) -> dict:
        loop = asyncio.get_running_loop()
        seq = _Seq(
            rid=str(body.get("rid") or f"{uuid.uuid4().hex[:8]}-{next(counter)}"),
            prompt=list(input_ids),
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)),
            stop_ids=set(sp.get("stop_token_ids") or []),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            future=loop.create_future(),
            loop=loop,
        )
        if seq.max_new_tokens <= 0:
            return {"text": "", "output_ids": [], "meta_info": {
                "id": seq.rid, "finish_reason": {"type": "length"}, "prompt_tokens": len(input_ids),
                "completion_tokens": 0, "output_token_logprobs": [],
                "weight_version": engine.weight_version}}
        engine.submit(seq)
        return await seq.future

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = body.get("input_ids")
        if ids is None and body.get("text") is not None:
            text = body["text"]
            ids = ([engine.tokenizer.encode(t) for t in text] if isinstance(text, list)
                   else engine.tokenizer.encode(text))
        if not ids:
            return _error(400, "input_ids (or text) is required and must not be empty")
        sp = body.get("sampling_params") or {}
        if isinstance(ids[0], list):
            # A batch: one sampling_params for all, or a list with one per sample (SGLang).
            params = sp if isinstance(sp, list) else [sp] * len(ids)
            if len(params) != len(ids):
                return _error(400, "sampling_params list must match the input_ids batch")
            return await asyncio.gather(*[_one(body, x, p) for x, p in zip(ids, params, strict=True)])
        return await _one(body, ids, sp)

    @app.post("/pause_generation")
    async def pause_generation():
        await asyncio.to_thread(engine.pause)
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await request.json()
        if not body.get("model_path"):
            return _error(400, "model_path is required")
        version = body.get("weight_version")
        result = await asyncio.to_thread(engine.update_weights, body["model_path"],
                                         None if version is None else str(version))
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group():
        return _error(501, "NCCL weight sync needs CUDA and SGLang; use weight_sync: disk")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed():
        return _error(501, "NCCL weight sync needs CUDA and SGLang; use weight_sync: disk")

    @app.post("/flush_cache")
    async def flush_cache():
        return {"success": True}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/health_generate")
    async def health_generate():
        return {}

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path,
                "is_generation": True, "weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info():
        return {"version": "oolong-embedded", **engine.stats()}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

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
