"""The engine in a process of its own, behind the embedded server's HTTP front end.

Why: a Python process has one GIL. With the front end (uvicorn, FastAPI, pydantic, JSON) in the
engine's process, handling requests took the GIL from the decode loop, whose many small torch
calls each give it up and take it back. On the long-tail benchmark (asynchronous side) py-spy
``--gil`` found the front end holding the GIL 18% of the time, the engine 21%; a thread holding
it a quarter of the time made a decode step at 64 rows twice as slow (4.1 -> 8.3 ms). SGLang
splits the same way: its HTTP server and TokenizerManager in one process, the Scheduler in
another, over ZMQ.

The protocol over one multiprocessing pipe (pickled tuples):

    front end -> engine   ("generate", [(key, rid, input_ids, sampling), ...])
                          ("generate", [(key, rid, input_ids, sampling, True)])  streamed
                          ("call", call_id, name, kwargs)       one of _EngineHost.CALLS
    engine -> front end   ("ready", info) | ("failed", message)  once, at start
                          ("results", [(key, response), ...])    finished requests, batched
                          ("progress", key, tokens, logprobs)      a streamed request's new ones
                          ("reply", call_id, ok, value)           a call's value, or its error

The engine process reads the pipe on its main thread (blocked in ``recv``, off the GIL) and runs
each call on a thread of its own, since a pause or a weight update waits for the engine. It
exits when the pipe closes: the front end is gone, however it died.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from training_core.dtypes import torch_dtype
from training_core.rollout_server import lora
from training_core.rollout_server.generation_engine import GenerationEngine, Seq
from training_core.rollout_server.requests import context_problem
from training_core.transport.weight_group import (
    broadcast_from_trainer,
    destroy_weight_update_group,
    flat_nbytes,
    init_weight_update_group,
    unflatten,
)

TENSOR_ADAPTER = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors (LoRARef)

log = logging.getLogger("oolong.server")


class EngineError(RuntimeError):
    """A request failed in the engine (its decode step raised); the others go on."""


# ---- the engine process -------------------------------------------------------------------------


class _Link:
    """The engine process's sending end: one lock for the threads that send (the engine's, the
    main one's, the calls'), and per thread the batch of results being collected (the engine
    answering finished requests, the main thread answering at once those it cannot queue)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self._local = threading.local()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def result(self, key: int, value: Any) -> None:
        """Only inside :meth:`batch`, on the thread that opened it."""
        self._local.results.append((key, value))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self._local.results = []
        try:
            yield
        finally:
            results, self._local.results = self._local.results, None
            if results:
                self.send(("results", results))


class _PipeFuture:
    """A request's future in the engine process (the engine sets it when the request finishes);
    its value goes back over the pipe."""

    def __init__(self, link: _Link, key: int):
        self.link, self.key, self._done = link, key, False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._done = True
        self.link.result(self.key, value)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.link.result(self.key, EngineError(f"{type(exc).__name__}: {exc}"))


def streamer(link: _Link, key: int):
    """A streamed request's progress hook: its new tokens since the last call, over the pipe."""
    sent = [0]

    def progress(seq: Seq) -> None:
        n = len(seq.output)
        if n > sent[0]:
            link.send(("progress", key, seq.output[sent[0]:n], seq.logprobs[sent[0]:n]))
            sent[0] = n

    return progress


class _PipeLoop:
    """What the engine calls a request's event loop: the engine hands it the callback that sets
    the futures of the requests that just finished; run at once, one message for all of them."""

    def __init__(self, link: _Link):
        self.link = link

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        with self.link.batch():
            fn(*args)


class _EngineHost:
    """The engine process's side: requests into the engine, calls to it."""

    CALLS = ("pause", "resume", "update_weights_from_disk", "init_weights_update_group",
             "update_weights_from_distributed", "destroy_weights_update_group",
             "get_weights_by_name", "stats", "abort_request", "flush_cache", "apply_adapter",
             "set_weight_version", "load_received_adapter", "forget_adapter")

    def __init__(self, engine: GenerationEngine, link: _Link):
        self.engine, self.link = engine, link
        self.loop = _PipeLoop(link)
        self.groups: dict[str, Any] = {}
        # [issue 49] an adapter's tensors received over the weight group, until
        # /load_lora_adapter_from_tensors names them; then kept by name (a few MB each) so
        # the newest left can be served again when the one serving is unloaded
        self.received_adapter: dict[str, torch.Tensor] = {}
        self.tensor_adapters: dict[str, tuple[dict, dict[str, torch.Tensor]]] = {}
        self.group_bytes = 0  # received over weight groups, for /server_info
        self.group_updates = 0

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"context_len": e.context_len, "model_type": e.model.config.model_type,
                "architectures": getattr(e.model.config, "architectures", None),
                "bos_token_id": e.tokenizer.bos_token_id}

    def generate(self, rows: list[tuple]) -> None:
        e = self.engine
        with self.link.batch():  # the requests answered at once (below) go back together
            for key, rid, input_ids, sp, *streamed in rows:
                seq = Seq(
                    rid=rid, prompt=list(input_ids), max_new_tokens=sp["max_new_tokens"],
                    temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                    stop_ids=set(sp["stop_token_ids"] or []), ignore_eos=sp["ignore_eos"],
                    future=_PipeFuture(self.link, key), loop=self.loop, version=e.weight_version,
                    progress=streamer(self.link, key) if streamed and streamed[0] else None)
                problem = context_problem(len(input_ids), sp["max_new_tokens"], e.context_len)
                if problem is not None:
                    # The front end refuses these with a 400 (server.py); one that reaches the
                    # engine anyway is aborted at once, with no tokens, never trimmed.
                    self.link.result(key, e.response(seq, {"type": "abort", "status_code": 400,
                                                           "message": problem}))
                elif seq.max_new_tokens <= 0:
                    self.link.result(key, e.response(seq, {"type": "length", "length": 0}))
                else:
                    e.submit(seq)

    def call(self, call_id: int, name: str, kwargs: dict[str, Any]) -> None:
        try:
            if name not in self.CALLS:
                raise ValueError(f"unknown call {name!r}")
            value, ok = getattr(self, f"_{name}")(**kwargs), True
        except Exception as exc:  # the front end turns it into the reply SGLang would give
            value, ok = f"{type(exc).__name__}: {exc}", False
        self.link.send(("reply", call_id, ok, value))

    # ---- calls ----------------------------------------------------------------------------------

    def _pause(self, mode: str) -> None:
        self.engine.pause(mode)

    def _resume(self) -> None:
        self.engine.resume()

    def _update_weights_from_disk(self, **kwargs: Any) -> dict:
        return self.engine.update_weights(**kwargs)

    def _init_weights_update_group(self, group_name: str, backend: str, **kwargs: Any) -> dict:
        if group_name in self.groups:
            return {"success": False, "message": f"group {group_name!r} exists; destroy it first"}
        # SGLang's backend default is nccl: a CPU engine can only speak gloo.
        backend = backend if self.engine.device.type == "cuda" else "gloo"
        try:  # blocks until every rank has joined
            self.groups[group_name] = init_weight_update_group(group_name=group_name,
                                                               backend=backend, **kwargs)
        except Exception as exc:
            return {"success": False, "message": f"failed to join weight update group: "
                                                 f"{type(exc).__name__}: {exc}"}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_weights_from_distributed(self, group_name: str, **kwargs: Any) -> dict:
        group = self.groups.get(group_name)
        if group is None:
            return {"success": False, "message": f"no weight update group {group_name!r}: call "
                                                 "/init_weights_update_group first"}
        if lora.is_adapter(kwargs["names"]):
            return self._receive_adapter(group, **kwargs)
        result = self.engine.update_weights_from_group(group, **kwargs)
        if result.get("success"):
            self._received(kwargs["dtypes"], kwargs["shapes"])
        return result

    def _received(self, dtypes: list[str], shapes: list[list[int]]) -> None:
        self.group_bytes += flat_nbytes([torch_dtype(d) for d in dtypes], shapes)
        self.group_updates += 1

    def _receive_adapter(self, group: Any, names: list[str], dtypes: list[str],
                         shapes: list[list[int]], flattened: bool = False,
                         **_: Any) -> dict:
        """[issue 49] A LoRA run's adapter over the weight group: received into tensors on the
        engine's device (NCCL takes no CPU tensors, as for the model's own weights) and held
        until ``/load_lora_adapter_from_tensors`` names it; the served weights stay as they are
        (a version's adapter may come in several buckets)."""
        try:
            kinds = [torch_dtype(d) for d in dtypes]
            if flattened:
                flat = torch.empty(flat_nbytes(kinds, shapes), dtype=torch.uint8,
                                   device=self.engine.device)
                broadcast_from_trainer(group, [flat])
                tensors = unflatten(flat, kinds, shapes)  # views of a buffer of their own
            else:
                tensors = [torch.empty(shape, dtype=k, device=self.engine.device)
                           for k, shape in zip(kinds, shapes, strict=True)]
                broadcast_from_trainer(group, tensors)
        except (TypeError, ValueError) as exc:
            return {"success": False, "message": f"cannot allocate the announced tensors: {exc}"}
        self.received_adapter.update(zip(names, tensors, strict=True))
        self._received(dtypes, shapes)
        return {"success": True, "message": f"received {len(names)} adapter tensors; load them "
                                            "with /load_lora_adapter_from_tensors"}

    def _load_received_adapter(self, name: str, config: dict) -> dict:
        if not self.received_adapter:
            return {"success": False, "message": "serialized_named_tensors: empty, and no "
                    "adapter tensors came over the weight update group (announce them with "
                    "/update_weights_from_distributed first)"}
        adapter = (config, self.received_adapter)
        result = self.engine.apply_adapter(None, adapter=adapter)
        if result.get("success"):
            self.tensor_adapters[name] = adapter
            self.received_adapter = {}
        return result

    def _forget_adapter(self, name: str) -> None:
        self.tensor_adapters.pop(name, None)

    def _destroy_weights_update_group(self, group_name: str) -> dict:
        group = self.groups.pop(group_name, None)
        if group is None:
            return {"success": False, "message": f"no group {group_name!r}"}
        destroy_weight_update_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def _apply_adapter(self, path: str | None, name: str | None = None) -> dict:
        if path == TENSOR_ADAPTER:  # one received over the weight group, served again
            return self.engine.apply_adapter(None, adapter=self.tensor_adapters[name])
        return self.engine.apply_adapter(path)

    def _set_weight_version(self, version: str, abort_first: bool) -> dict:
        return self.engine.set_weight_version(version, abort_first=abort_first)

    def _get_weights_by_name(self, name: str, truncate_size: int) -> list | None:
        # A read between decode steps would race the engine thread only while weights load,
        # under the writer lock; a tensor read here is a copy.
        params = dict(self.engine.model.named_parameters(remove_duplicate=False))
        if name not in params:
            return None
        return params[name].detach()[:truncate_size].float().cpu().tolist()

    def _stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "model_path": self.engine.model_path,
                "weight_group_bytes_received": self.group_bytes,
                "weight_group_updates_received": self.group_updates}

    def _abort_request(self, rid: str) -> None:
        self.engine.abort_request(rid)

    def _flush_cache(self) -> None:
        self.engine.flush_cache()


def _serve(conn: Connection, other_end: Connection, threads: int,
           engine_kwargs: dict[str, Any]) -> None:
    """The engine process's main: load the model, then read the pipe until it closes."""
    other_end.close()  # the front end's end, inherited: held open here, EOF would never come
    # A supervisor's SIGTERM (or a Ctrl-C) reaches the whole process group: the front end
    # shuts down and closes the pipe, and the engine follows (nothing logged as a crash).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    link = _Link(conn)
    try:
        engine = GenerationEngine(**engine_kwargs)
    except Exception as exc:
        link.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    host = _EngineHost(engine, link)
    link.send(("ready", host.info()))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "generate":
                host.generate(message[1])
            elif message[0] == "call":
                threading.Thread(target=host.call, args=message[1:], daemon=True,
                                 name=f"call-{message[2]}").start()
    finally:
        engine.shutdown()


# ---- the front end's side -----------------------------------------------------------------------


class EngineProcess:
    """Starts the engine process and talks to it from the front end's event loop: ``generate``
    and ``call`` are coroutines; replies are read by the loop itself (``add_reader``), so the
    front end has no thread of its own for them."""

    def __init__(self, *, threads: int = 1, **engine_kwargs: Any):
        # On CPU, fork: the front end has imported torch and transformers already and started
        # nothing (no threads, no sockets), so the engine starts without importing them again.
        # CUDA cannot be used in a forked child once the parent has touched it: spawn there.
        on_cpu = str(engine_kwargs.get("device", "cpu")).startswith("cpu")
        ctx = mp.get_context("fork" if on_cpu and hasattr(os, "fork") else "spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, self._conn, threads, engine_kwargs),
                                    name="oolong-engine", daemon=True)
        self._process.start()
        child.close()
        message = self._recv_start()
        if message[0] != "ready":
            self._process.join(timeout=10)
            raise RuntimeError(f"the engine failed to start: {message[1]}")
        self.info: dict[str, Any] = message[1]
        self._keys = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # streamed requests' progress
        self._loop: asyncio.AbstractEventLoop | None = None

    def _recv_start(self) -> tuple:
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(timeout=10)
            return ("failed", f"the engine process exited with code {self._process.exitcode}")

    def close(self) -> None:
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()

    async def generate(self, rows: list[tuple[str, list[int], dict[str, Any]]]) -> list[dict]:
        """Generate for each ``(rid, input_ids, sampling_params)``; SGLang's response items."""
        loop = self._attach()
        keys = [next(self._keys) for _ in rows]
        futures = []
        for key in keys:
            futures.append(loop.create_future())
            self._pending[key] = futures[-1]
        self._send(("generate", [(k, *row) for k, row in zip(keys, rows, strict=True)]))
        return list(await asyncio.gather(*futures))

    async def generate_stream(self, rid: str, input_ids: list[int], sampling: dict[str, Any]):
        """One request, streamed: yields ``(tokens, logprobs)`` of each step's new tokens, then
        SGLang's response item (a dict) once it finished."""
        loop = self._attach()
        key = next(self._keys)
        self._pending[key] = future = loop.create_future()
        self._streams[key] = queue = asyncio.Queue()
        self._send(("generate", [(key, rid, input_ids, sampling, True)]))
        try:
            while True:
                waiter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({waiter, future}, return_when=asyncio.FIRST_COMPLETED)
                if waiter in done:
                    yield waiter.result()
                    continue
                waiter.cancel()
                while not queue.empty():  # what came in before the end
                    yield queue.get_nowait()
                yield await future
                return
        finally:
            self._streams.pop(key, None)
            self._pending.pop(key, None)

    async def call(self, op: str, /, **kwargs: Any) -> Any:
        """Run one of the engine's calls (``_EngineHost.CALLS``) and return its value."""
        loop = self._attach()
        key = next(self._keys)
        self._pending[key] = future = loop.create_future()
        self._send(("call", key, op, kwargs))
        return await future

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as exc:
            self._died(f"cannot reach the engine process: {exc}")

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._conn.fileno(), self._drain)
        elif loop is not self._loop:
            raise RuntimeError("EngineProcess is bound to the event loop that first used it")
        return loop

    def _drain(self) -> None:
        try:
            while self._conn.poll():
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            self._process.join(timeout=5)
            self._died(f"the engine process exited with code {self._process.exitcode}")

    def _dispatch(self, message: tuple) -> None:
        if message[0] == "progress":
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait((message[2], message[3]))
        elif message[0] == "results":
            for key, value in message[1]:
                self._settle(key, value, ok=not isinstance(value, EngineError))
        elif message[0] == "reply":
            _, key, ok, value = message
            self._settle(key, value if ok else RuntimeError(value), ok=ok)

    def _settle(self, key: int, value: Any, *, ok: bool) -> None:
        future = self._pending.pop(key, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _died(self, message: str) -> None:
        """Nothing can be generated any more: the server exits (its requests' connections drop,
        and a supervisor restarts it; a front end without an engine would answer 500s). The
        pipe's end of file reaches the reader as soon as the engine process is gone."""
        log.error("%s; the server exits", message)
        os._exit(1)
