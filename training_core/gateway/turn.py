"""One turn of a session: the prompt as exact ids, one generation, the answer as the agent's
API returns it. Every API of the gateway (chat completions, responses, Anthropic messages)
runs its requests through :class:`TurnRunner`; they differ only in how they read the request
and write the answer.

A turn is transactional: the session changes only when the generation succeeded and the agent
got its answer. A prompt refused (over the context, rejected by the server) leaves the session
as it was, so the agent can trim its history and try again.

Stop strings are applied here, not by the servers: the completion is cut after the token that
completes the first stop string; the tokens up to it are kept and trained exactly as sampled (a
prefix of a sample is a sample), the text is trimmed before the stop string, and a streamed
generation is cancelled as soon as the stop string appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from training_core.api import (
    EpisodeError,
    GenerationAborted,
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    RequestRejected,
    SamplingParams,
)
from training_core.gateway.chat import ChatRenderer, canonical
from training_core.gateway.requests import BadRequest, TurnRequest
from training_core.gateway.sampling import Decision, decide
from training_core.gateway.session import Segment, Session, SessionFailed
from training_core.gateway.tools import (
    MISTRAL_CALLS,
    PYTHON_TAG,
    THINK_CLOSE,
    THINK_OPEN,
    Parsed,
    first_call_end,
    forced_prefix,
    parse_tool_calls,
    split_reasoning,
)

CONTEXT_CODE = "context_length_exceeded"  # OpenAI's code, which agent frameworks key on
MAX_RESPONSES_KEPT = 32


@dataclass
class Plan:
    """The prompt of a turn, computed before anything in the session changes."""

    prompt: list[int]
    extends: bool  # continues the current segment (else a new one: the whole prompt)
    delta: list[int]  # ids appended to the current segment
    new_messages: list[dict[str, Any]]
    tools_key: str
    prefix_text: str = ""  # a forced tool-call opening, in the prompt
    prefix_ids: list[int] = field(default_factory=list)
    opened_reasoning: bool = False


@dataclass
class Answer:
    """A finished turn as every API needs it."""

    id: str
    created: int
    text: str  # the model's text (after stop trimming), markers kept
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish: str  # stop | length | tool_calls
    stop_matched: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[tuple[str, float]]
    overridden: list[str]


@dataclass
class Delta:
    kind: str  # "content" | "reasoning"
    text: str


def _hold(text: str, markers: list[str]) -> int:
    """How much of the end of ``text`` may still become one of ``markers``."""
    for n in range(min(len(text), max((len(m) for m in markers), default=0)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class View:
    """What of a growing completion an agent may already see, so that every streamed delta is
    a prefix of the final answer: reasoning and content are held back while their end could
    still turn out to be a stop string, a tool-call marker or trailing space."""

    def __init__(self, family: str, tools_on: bool, opened: bool, stop: list[str]):
        self.family, self.tools_on, self.opened, self.stop = family, tools_on, opened, stop
        self.sent = {"reasoning": "", "content": ""}
        markers = {"llama3": [PYTHON_TAG], "mistral": [MISTRAL_CALLS]}.get(
            family, ["<tool_call>"])
        self.markers = markers if tools_on else []

    def _visible(self, text: str) -> tuple[str, str]:
        held = list(self.stop)
        for stop in self.stop:  # the answer ends before a stop string
            if stop in text:
                text = text[: text.index(stop)]
        stripped = text.lstrip()
        if not self.opened and THINK_OPEN.startswith(stripped):
            return "", ""  # nothing yet, or it could still open <think>
        reasoning, rest = "", text
        if self.opened or stripped.startswith(THINK_OPEN):
            body = stripped[len(THINK_OPEN):] if stripped.startswith(THINK_OPEN) else text
            if THINK_CLOSE not in body:
                body = body[: len(body) - _hold(body, [THINK_CLOSE, *held])]
                return body.strip(), ""
            reasoning, _, rest = body.partition(THINK_CLOSE)
            reasoning, rest = reasoning.strip(), rest.lstrip()
        cut = len(rest)
        for marker in self.markers:
            i = rest.find(marker)
            if i >= 0:
                cut = min(cut, i)
        if self.tools_on and self.family == "llama3" and rest.lstrip().startswith("{"):
            cut = 0  # the whole answer may be a call
        rest = rest[:cut]
        rest = rest[: len(rest) - _hold(rest, [*self.markers, *held])]
        return reasoning, rest.rstrip()

    def update(self, text: str) -> list[Delta]:
        out = []
        for kind, now in zip(("reasoning", "content"), self._visible(text), strict=True):
            if now.startswith(self.sent[kind]) and len(now) > len(self.sent[kind]):
                out.append(Delta(kind, now[len(self.sent[kind]):]))
                self.sent[kind] = now
        return out

    def finish(self, reasoning: str | None, content: str | None) -> tuple[list[Delta], str, str]:
        """The deltas that complete the answer, and the reasoning and content the agent ends up
        with (a streamed prefix cannot be taken back)."""
        out, final = [], {}
        for kind, value in (("reasoning", reasoning or ""), ("content", content or "")):
            sent = self.sent[kind]
            if value.startswith(sent):
                if len(value) > len(sent):
                    out.append(Delta(kind, value[len(sent):]))
                final[kind] = value
            else:
                final[kind] = sent
        return out, final["reasoning"], final["content"]


class TurnRunner:
    """Runs turns for a gateway (its engine, rendering, the run's sampling and policy)."""

    def __init__(self, engine: InferenceEngine, renderer: ChatRenderer, sampling: SamplingParams,
                 policy: str = "override", max_context: int | None = None):
        self.engine, self.renderer, self.sampling, self.policy = engine, renderer, sampling, policy
        self.max_context = max_context if max_context is not None else renderer.max_context
        # Rendering and tokenizing run here, one at a time: never on the event loop (a 4 MB
        # message must not stall every episode), and a fast tokenizer is not used concurrently.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-tokenize")

    def close(self) -> None:
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    # ---- the prompt -------------------------------------------------------------------------

    def _too_long(self, n: int) -> BadRequest:
        return BadRequest("messages", f"this model's maximum context length is {self.max_context} "
                          f"tokens, and the messages take {n}: shorten the conversation (the "
                          "episode goes on)", code=CONTEXT_CODE)

    def plan(self, session: Session, req: TurnRequest) -> Plan:
        """The prompt: a continuation of the current segment's exact ids when the messages
        extend the last request plus its answer (and the tools are the same), else the whole
        conversation rendered as a new segment. Changes nothing. Runs off the event loop."""
        tools_key = json.dumps(req.tools, sort_keys=True)
        old = session.history
        new_canon = [canonical(m) for m in req.messages]
        prefix_text = ""
        if req.tools and (req.tool_choice == "required" or req.forced_tool):
            prefix_text = forced_prefix(self.renderer.family, req.forced_tool)
        prefix_ids = self.renderer.encode(prefix_text) if prefix_text else []
        plan = None
        if (old is not None and session.segments and tools_key == session.tools_key
                and len(new_canon) > len(old) and new_canon[: len(old)] == old):
            delta = self.renderer.continuation(req.messages[len(old):], req.tools,
                                               session.last_output_id)
            if delta is not None:
                plan = Plan(session.segments[-1].ids + delta, True, delta,
                            new_canon[len(old):], tools_key)
        if plan is None:
            try:
                ids = self.renderer.full(req.messages, req.tools)
            except Exception as exc:  # jinja2's TemplateError, raise_exception(...) included
                raise BadRequest("messages", "the model's chat template refused these messages: "
                                 f"{exc}") from None
            plan = Plan(ids, False, ids, new_canon, tools_key)
        plan.prefix_text, plan.prefix_ids = prefix_text, prefix_ids
        plan.prompt = plan.prompt + prefix_ids
        plan.opened_reasoning = self.renderer.opens_reasoning(plan.prompt)
        return plan

    # ---- a turn -----------------------------------------------------------------------------

    async def start(self, session: Session, req: TurnRequest) -> Turn:
        """Checks, the prompt and the session's lock; raises :class:`BadRequest` before any
        token is generated. The returned turn holds the lock until it is run or closed."""
        decision = decide(self.policy, self.sampling, req.sampling)
        if self.max_context and req.text_size() > self.max_context * self.renderer.max_token_chars:
            session.rejected += 1
            raise self._too_long(req.text_size() // self.renderer.max_token_chars)
        await session.lock.acquire()
        try:
            try:
                budget = session.budget(req.max_tokens, self.sampling.max_new_tokens)
            except SessionFailed as exc:
                raise BadRequest(None, str(exc), status=429, code="episode_limit") from None
            plan = await self._off_loop(self.plan, session, req)
            if self.max_context:
                room = self.max_context - len(plan.prompt)
                if room < 1:
                    session.rejected += 1
                    raise self._too_long(len(plan.prompt))
                budget = min(budget, room)
            return Turn(self, session, req, plan, decision, budget)
        except BaseException:
            session.lock.release()
            raise


class Turn:
    """A started turn: ``run()`` generates and returns the answer; ``stream()`` yields the
    deltas as tokens arrive and then the answer. Either commits the turn to the session and
    releases its lock; ``close()`` releases it without a turn."""

    def __init__(self, runner: TurnRunner, session: Session, req: TurnRequest, plan: Plan,
                 decision: Decision, budget: int):
        self.runner, self.session, self.req, self.plan = runner, session, req, plan
        self.decision = decision
        self.sampling = replace(decision.sampling, max_new_tokens=budget)
        self.family = runner.renderer.family
        self.tools_on = bool(req.tools) and req.tool_choice != "none"
        self.view = View(self.family, self.tools_on, plan.opened_reasoning, req.stop)
        self._locked = True
        self.stop_matched: str | None = None
        self.id = secrets.token_hex(12)
        self.created = int(time.time())

    def close(self) -> None:
        if self._locked:
            self._locked = False
            self.session.lock.release()

    async def run(self) -> Answer:
        async with contextlib.aclosing(self.stream()) as items:  # the lock, even if cancelled
            async for item in items:
                if isinstance(item, Answer):
                    return item
        raise AssertionError("a turn ends with its answer")  # pragma: no cover

    async def stream(self) -> AsyncIterator[Delta | Answer]:
        try:
            resp = None
            async for resp, cut in self._generate():
                if not self.req.stream:
                    continue
                for delta in self.view.update(self._model_text(resp, cut)):
                    yield delta
            assert resp is not None
            answer = self._commit(resp, cut)
            if self.req.stream:
                deltas, reasoning, content = self.view.finish(answer.reasoning, answer.content)
                for delta in deltas:
                    yield delta
                # What the agent assembles from the stream is what the next turn must match.
                answer.reasoning = reasoning or None
                answer.content = content if content or not answer.tool_calls else None
                self._remember(answer)
            yield answer
        finally:
            self.close()

    # ---- generation -------------------------------------------------------------------------

    def _model_text(self, resp: GenerationResponse, cut: int | None) -> str:
        ids = resp.output_ids if cut is None else resp.output_ids[:cut]
        return self.runner.renderer.decode(ids)

    def _stop_cut(self, ids: list[int]) -> tuple[int | None, str | None]:
        """Where the completion ends early: after the token that completes a stop string, or
        (``parallel_tool_calls: false``) the first closed tool call. (None, None): it does not."""
        decode = self.runner.renderer.decode
        text = decode(ids)
        hits = [(text.find(s), s) for s in self.req.stop if s in text]
        end_of_call = None
        if self.tools_on and not self.req.parallel_tool_calls:
            end_of_call = first_call_end(self.plan.prefix_text + text, self.family)
            if end_of_call is not None:
                end_of_call -= len(self.plan.prefix_text)
                if end_of_call >= len(text):  # the first call is all there is so far
                    end_of_call = None
        if not hits and end_of_call is None:
            return None, None
        matched = min(hits)[1] if hits else None

        def done(k: int) -> bool:
            t = decode(ids[:k])
            return (matched is not None and matched in t) or (
                end_of_call is not None and len(t) >= end_of_call)

        lo, hi = 1, len(ids)  # the shortest prefix that already holds it
        while lo < hi:
            mid = (lo + hi) // 2
            if done(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo, matched

    async def _generate(self) -> AsyncIterator[tuple[GenerationResponse, int | None]]:
        engine = self.runner.engine
        # One session, one server: the conversation so far is in that server's prefix cache.
        request = GenerationRequest(self.plan.prompt, self.sampling, route_key=self.session.id)
        stream = getattr(engine, "agenerate_stream", None)
        try:
            if stream is None or not (self.req.stream or self.req.stop):
                resp = await engine.agenerate(request)
                cut, self.stop_matched = self._stop_cut(resp.output_ids)
                yield resp, cut
                return
            updates = stream(request)
            try:
                async for resp in updates:
                    cut, self.stop_matched = self._stop_cut(resp.output_ids)
                    yield resp, cut
                    if cut is not None:
                        break
            finally:
                await updates.aclose()
        except RequestRejected as exc:  # the prompt: the episode goes on
            self.session.rejected += 1
            raise BadRequest("messages", f"the rollout server refused the prompt: {exc}",
                             code="invalid_prompt") from None
        except GenerationAborted as exc:
            raise BadRequest(None, f"generation was interrupted: {exc}; retry", status=503,
                             code="generation_interrupted") from None
        except EpisodeError as exc:
            self.session.fail(f"generation failed: {exc}")
            raise BadRequest("messages", f"generation failed: {exc}") from None
        except Exception as exc:  # the servers are down: the run fails, not this episode
            self.session.fatal = exc
            self.session.fail(f"rollout servers failed: {exc}")
            raise BadRequest(None, "rollout servers unavailable", status=503) from None

    # ---- the answer -------------------------------------------------------------------------

    def _parse(self, text: str) -> tuple[str | None, Parsed]:
        reasoning, rest = split_reasoning(text, self.plan.opened_reasoning)
        if self.tools_on:
            parsed = parse_tool_calls(self.plan.prefix_text + rest, self.family)
            if not self.req.parallel_tool_calls and len(parsed.tool_calls) > 1:
                parsed.tool_calls = parsed.tool_calls[:1]
        else:
            parsed = Parsed(rest)
        return reasoning, parsed

    def _commit(self, resp: GenerationResponse, cut: int | None) -> Answer:
        session, plan = self.session, self.plan
        stop_matched = self.stop_matched
        if cut is not None:
            resp = replace(resp, output_ids=resp.output_ids[:cut],
                           output_logprobs=resp.output_logprobs[:cut],
                           output_versions=resp.output_versions[:cut], finish_reason="stop")
        text = self.runner.renderer.decode(resp.output_ids)
        if stop_matched is not None:
            text = text[: text.find(stop_matched)]
        reasoning, parsed = self._parse(text)
        # The session changes only now: the generation succeeded.
        if plan.extends:
            session.segments[-1].add_prompt(plan.delta + plan.prefix_ids)
        else:
            session.forks += bool(session.segments)
            session.segments.append(Segment.from_prompt(plan.prompt))
        turn = session.turns
        session.turns += 1
        session.sampled_tokens += len(resp.output_ids)
        session.interruptions += resp.interruptions
        session.tools_key = plan.tools_key
        # 0.0: the run's temperature; another only under rollout.agent.sampling: pass.
        own = self.sampling.temperature != self.runner.sampling.temperature
        session.segments[-1].add_output(resp, turn, trained=self.decision.trained,
                                        temperature=self.sampling.temperature if own else 0.0)
        session.last_output_id = resp.output_ids[-1] if resp.output_ids else None
        session.tool_parse_failures += parsed.failed
        session.tool_calls += len(parsed.tool_calls)
        session.sampling_overrides += bool(self.decision.overridden)
        finish = ("tool_calls" if parsed.tool_calls else
                  "length" if resp.finish_reason == "length" else "stop")
        answer = Answer(
            id=self.id, created=self.created, text=text, content=parsed.content,
            reasoning=reasoning, tool_calls=parsed.tool_calls, finish=finish,
            stop_matched=stop_matched, prompt_tokens=len(plan.prompt),
            completion_tokens=len(resp.output_ids),
            cached_tokens=len(plan.prompt) - len(plan.delta) - len(plan.prefix_ids)
            if plan.extends else 0,
            logprobs=[(self.runner.renderer.tok.decode([t], skip_special_tokens=False), lp)
                      for t, lp in zip(resp.output_ids, resp.output_logprobs, strict=True)],
            overridden=list(self.decision.overridden))
        session.log.append({"turn": turn, "segment": len(session.segments) - 1,
                            "new_messages": plan.new_messages, "completion": text,
                            "tool_calls": parsed.tool_calls, "finish_reason": finish,
                            "versions": sorted(set(resp.output_versions)),
                            "tool_parse_failed": parsed.failed,
                            **({"sampling_overridden": answer.overridden}
                               if answer.overridden else {}),
                            **({"trained": False} if not self.decision.trained else {})})
        session.completion_ids.append(answer.id)
        session.last_active = time.monotonic()
        self._remember(answer)
        return answer

    def _remember(self, answer: Answer) -> None:
        """The conversation the next request must extend: this request's messages and the
        answer as the agent received it."""
        message: dict[str, Any] = {"role": "assistant", "content": answer.content or ""}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        self.session.history = [canonical(m) for m in self.req.messages] + [canonical(message)]
        self.session.responses[answer.id] = list(self.req.messages[self.req.instructions:]) + [
            message]
        while len(self.session.responses) > MAX_RESPONSES_KEPT:
            self.session.responses.pop(next(iter(self.session.responses)))
