"""Agents as workflows: ``rollout.workflow: agent:<module>:<callable>``.

The user's callable is an agent written against the OpenAI API::

    def run(base_url: str, api_key: str, item: dict) -> float | list[float]:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...                      # any number of chat completions, tools, its own logic
        return reward            # one float, or one per completion

(an ``async def`` works too; a class is instantiated without arguments and its ``run`` or
``__call__`` is used). Each of the G episodes of a task item runs it once, as a subprocess in
the jail (training_core.jail: namespaces, never host root, seccomp, a cgroup, a sized tmpfs
``/scratch``), whose only reachable endpoint is its own session of the gateway: the session
listens on a Unix socket bound alone into the jail, and a forwarder inside the jail's network
namespace serves it
on ``127.0.0.1:<port>``, so an unmodified SDK with ``base_url=http://127.0.0.1:<port>/v1``
works. The jail has no other network at all.

The module is copied into the jail as one file (``user_agent.py``): it may import the jail
runtime's packages (``openai``, ``httpx``, ...: ``training_core/jail/runtime.py``), not sibling
files.

Failures (an exception in the agent, a bad return value, the wall-time limit, the turn or token
limit): the episode is retried once (``rollout.agent.retries``) in a fresh session; if it fails
again the whole group is dropped (never scored 0) and counted as an episode error, with an event.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from training_core.api import EpisodeError, InferenceEngine, TrajectoryGroup
from training_core.gateway.chat import ChatRenderer
from training_core.gateway.credit import BadReward, episode_trajectories, turn_returns
from training_core.gateway.server import Gateway
from training_core.gateway.session import AgentLimits, Session
from training_core.jail import FILES_DIR, PROTOCOL_PRELUDE, Limits, python, spawn
from training_core.rewards.bounds import REWARD_MAX_ABS
from training_core.sandbox import strict_json
from training_core.workflows.base import WorkflowContext

log = logging.getLogger(__name__)

SOCKET = "gw.sock"
EVAL_CONCURRENCY = 8  # agent episodes of one evaluation at once (each is a jail)
ANSWER_BYTES = 64 * 1024

# Runs in the jail. The protocol is one JSON line each way on the original stdout; the agent's
# own prints go to /dev/null.
RUNNER = "import asyncio, inspect, json, math, os, socket, sys, threading\n" + PROTOCOL_PRELUDE + r'''

spec = json.loads(sys.stdin.readline())

# The loopback forwarder: 127.0.0.1:<port> in the jail's own network namespace -> the session's
# Unix socket. Nothing else is reachable: the namespace has no other interface.
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(64)
port = listener.getsockname()[1]

def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass

def accept():
    while True:
        conn, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(spec["socket"])
        except OSError:
            conn.close()
            continue
        threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()

threading.Thread(target=accept, daemon=True).start()

try:
    import importlib.util
    loaded = importlib.util.spec_from_file_location("user_agent", "FILES_DIR/user_agent.py")
    module = importlib.util.module_from_spec(loaded)
    sys.modules["user_agent"] = module
    loaded.loader.exec_module(module)
    target = getattr(module, spec["entrypoint"])
    if inspect.isclass(target):
        target = target()
        target = getattr(target, "run", target)
    result = target(base_url=f"http://127.0.0.1:{port}/v1", api_key=spec["api_key"],
                    item=spec["item"])
    if inspect.isawaitable(result):
        async def wait(r):
            return await r
        result = asyncio.run(wait(result))
    json.dumps(result, allow_nan=False)
    say({"result": result})
except BaseException as exc:
    say({"error": f"{type(exc).__name__}: {exc}"[:500]})
'''.replace("FILES_DIR", FILES_DIR)


class AgentFailed(RuntimeError):
    """One episode failed (the agent, a limit, a bad reward); the message says why."""


def agent_source(target: str) -> tuple[str, str]:
    """(source text, entrypoint) for ``<module>:<callable>``, the module given as a dotted name
    (importable here, or a file under the working directory) or a path to a ``.py`` file."""
    module, sep, entry = target.rpartition(":")
    if not sep or not module or not entry.isidentifier():
        raise ValueError(f"rollout.workflow 'agent:{target}' must look like "
                         "'agent:<module>:<callable>', e.g. agent:examples.calculator_agent:run")
    candidates = []
    if module.endswith(".py"):
        candidates.append(Path(module))
    else:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.origin and found.origin.endswith(".py"):
            candidates.append(Path(found.origin))
        candidates.append(Path(*module.split(".")).with_suffix(".py"))
    for path in candidates:
        if path.is_file():
            return path.read_text(), entry
    raise ValueError(f"rollout.workflow 'agent:{target}': no file for module {module!r} (an "
                     "importable module, or a .py path relative to the working directory)")


SUMMED = ("agent/tool_parse_failures", "agent/retries", "agent/sampling_overrides",
          "agent/rejected_requests")


def agent_metrics(samples: list[Any]) -> dict[str, float]:
    """Means of the ``agent/*`` numbers over the batch's episodes (kept on each episode's first
    segment); tool-parse failures, retries, overridden and rejected requests summed."""
    firsts = [s.info for s in samples if s.info.get("segment") == 0 and "episode" in s.info]
    keys = sorted({k for info in firsts for k in info if k.startswith("agent/")})
    out = {}
    for k in keys:
        values = [float(info.get(k, 0)) for info in firsts]
        total = k in SUMMED
        out[k] = sum(values) if total else sum(values) / len(values)
    return out


class AgentWorkflow:
    def __init__(self, ctx: WorkflowContext, target: str):
        self.ctx = ctx
        self.source, self.entrypoint = agent_source(target)
        settings = getattr(ctx, "agent", None)
        self.limits = AgentLimits(
            max_turns=getattr(settings, "max_turns", AgentLimits.max_turns),
            max_tokens=getattr(settings, "max_tokens", AgentLimits.max_tokens),
            timeout_s=getattr(settings, "timeout_s", AgentLimits.timeout_s))
        self.discount = getattr(settings, "discount", 1.0)
        self.retries = getattr(settings, "retries", 1)
        self.policy = getattr(settings, "sampling", "override")
        self.renderer = ChatRenderer(ctx.tokenizer, getattr(settings, "tool_format", "auto"))
        self.jail_limits = Limits(memory_mb=getattr(settings, "memory_mb", 2048),
                                  jail_memory_mb=getattr(settings, "memory_mb", 2048))
        self.gateway: Gateway | None = None
        # The agent's returns are held to the run's reward bound (reward.max_abs).
        self.max_abs = getattr(ctx.rewards, "max_abs", REWARD_MAX_ABS)
        self.eval_gateway: Gateway | None = None
        self._evaluating = asyncio.Semaphore(EVAL_CONCURRENCY)

    def _gateway(self, engine: InferenceEngine) -> Gateway:
        if self.gateway is None or self.gateway.engine is not engine:
            self.gateway = Gateway(engine, self.renderer, self.ctx.sampling, policy=self.policy)
        return self.gateway

    async def aevaluate(self, engine: InferenceEngine, item: dict[str, Any]) -> float:
        """One greedy episode (the evaluation gateway samples greedily whatever the agent asks
        for) and its reward: the agent's float, or its per-completion rewards summed. A failed
        episode raises :class:`EpisodeError` (evaluation scores it 0 and counts it)."""
        if self.eval_gateway is None or self.eval_gateway.engine is not engine:
            self.eval_gateway = Gateway(engine, self.renderer,
                                        replace(self.ctx.sampling, greedy=True), policy="override")
        gateway = self.eval_gateway
        async with self._evaluating:  # a jail per episode: not every eval row at once
            session = gateway.open_session(self.limits, item)
            try:
                result = await self._run_jailed(gateway, session, item)
                if session.fatal is not None:
                    raise session.fatal
                if session.failure is not None:
                    raise AgentFailed(session.failure)
                return turn_returns(result, session.turns, 1.0)[0] if session.turns else 0.0
            except (AgentFailed, BadReward) as exc:
                raise EpisodeError(f"agent evaluation episode failed: {exc}") from None
            finally:
                await gateway.close_session(session)

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> TrajectoryGroup | None:
        gateway = self._gateway(engine)
        results = await asyncio.gather(
            *[self._trajectory(gateway, item, i) for i in range(self.ctx.group_size)],
            return_exceptions=True)
        for r in results:  # the servers failed: the run must fail (the executor raises it)
            if isinstance(r, BaseException) and not isinstance(r, AgentFailed):
                raise r
        failed = [r for r in results if isinstance(r, AgentFailed)]
        if failed:
            raise EpisodeError(f"agent group dropped: {len(failed)} of {len(results)} episodes "
                               f"failed {1 + self.retries} times; first: {failed[0]}")
        return TrajectoryGroup(samples=[row for rows in results for row in rows])

    async def _trajectory(self, gateway: Gateway, item: dict[str, Any], episode: int) -> list:
        reasons = []
        for attempt in range(1 + self.retries):
            session = gateway.open_session(self.limits, item)
            try:
                result = await self._run_jailed(gateway, session, item)
                if session.fatal is not None:
                    raise session.fatal
                if session.failure is not None:  # a limit the agent caught and carried on past
                    raise AgentFailed(session.failure)
                try:
                    rows = episode_trajectories(session, result, episode=episode,
                                                discount=self.discount, max_abs=self.max_abs)
                except BadReward as exc:
                    raise AgentFailed(str(exc)) from None
                rows[0].info["agent/retries"] = attempt
                return rows
            except AgentFailed as exc:
                if session.fatal is not None:
                    raise session.fatal from None
                reasons.append(str(exc))
                log.warning("agent episode failed (attempt %d): %s", attempt + 1, exc)
            finally:
                await gateway.close_session(session)
        raise AgentFailed("; ".join(reasons))

    async def _run_jailed(self, gateway: Gateway, session: Session, item: dict[str, Any]) -> Any:
        # The agent's /scratch is the jail's own sized tmpfs (rollout.agent's jail limits),
        # gone with the jail: a host directory took 300 MB and 20,000 files in seconds and
        # outlived a killed trainer. Only the session's socket comes from the host, bound alone
        # into the jail; its directory is this process's (0700) and holds nothing else.
        host_dir = Path(tempfile.mkdtemp(prefix="oolong-agent-"))
        jail = None
        try:
            await gateway.serve_unix(session, str(host_dir / SOCKET))
            jail = await asyncio.to_thread(
                spawn, [python(), "-I", f"{FILES_DIR}/runner.py"], limits=self.jail_limits,
                files={"runner.py": RUNNER, "user_agent.py": self.source},
                sockets={SOCKET: host_dir / SOCKET},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            spec = {"socket": f"{FILES_DIR}/{SOCKET}", "api_key": session.key, "item": item,
                    "entrypoint": self.entrypoint}
            answer = await asyncio.to_thread(_exchange, jail.proc, spec, self.limits.timeout_s)
        finally:
            if jail is not None:
                await asyncio.to_thread(jail.kill)
            shutil.rmtree(host_dir, ignore_errors=True)
        if "error" in answer:
            raise AgentFailed(f"the agent raised {str(answer['error'])[:500]}"
                              + (f" ({session.failure})" if session.failure else ""))
        return answer["result"]


def _exchange(proc: subprocess.Popen, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send the episode's spec, wait for the one answer line (within ``timeout_s``)."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        # default=str: a dataset row may hold values JSON has no type for (dates, numpy scalars)
        proc.stdin.write((json.dumps(spec, default=str) + "\n").encode())
        proc.stdin.flush()
    except OSError:
        raise AgentFailed("the agent's jail did not start") from None
    fd, buffer = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AgentFailed(f"wall-time limit: no result within {timeout_s:g} s "
                              "(rollout.agent.timeout_s; the jail was killed)")
        if len(buffer) > ANSWER_BYTES:
            raise AgentFailed(f"the agent's answer is longer than {ANSWER_BYTES} bytes")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AgentFailed("the agent's process died (memory or CPU limit, or a crash)")
            buffer += chunk
    # Strict: NaN/Infinity constants and nesting deep enough for a RecursionError are garbage.
    answer = strict_json(buffer.partition(b"\n")[0])
    if not isinstance(answer, dict) or not ({"result", "error"} & answer.keys()):
        raise AgentFailed("the agent's jail answered garbage")
    return answer
