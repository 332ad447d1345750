"""Agent workflows: user agents in the jail, talking to the gateway with the real openai package."""

from __future__ import annotations

import datetime

import pytest

from tests.training_core.conftest import run_episode
from training_core.api import EpisodeError, SamplingParams
from training_core.config import AgentSpec
from training_core.models.loading import load_tokenizer
from training_core.workflows import load_workflow
from training_core.workflows.agent import agent_metrics
from training_core.workflows.base import WorkflowContext

AGENTS = "tests/training_core/agents/probe_agent.py"


def _workflow(tiny_model_dir, entry, group_size=2, **agent):
    ctx = WorkflowContext(tokenizer=load_tokenizer(tiny_model_dir), rewards=None,  # type: ignore[arg-type]
                          sampling=SamplingParams(max_new_tokens=6), group_size=group_size,
                          agent=AgentSpec(**{"timeout_s": 90, **agent}))
    return load_workflow(f"agent:{AGENTS}:{entry}", ctx)


def test_agent_episodes_become_segments_with_exact_tokens(server, tiny_model_dir):
    wf = _workflow(tiny_model_dir, "digits")
    # A row may hold values JSON has no type for: the agent gets them as text.
    group = run_episode(server, wf, {"question": "1+2=", "answer": "3", "when": datetime.date(2026, 1, 2)})
    episodes = {s.info["episode"] for s in group.samples}
    assert episodes == {0, 1}
    for s in group.samples:
        text = wf.renderer.tok.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m],
                                      skip_special_tokens=True)
        expected = sum(c.isdigit() for c in text) / max(len(text), 1)
        assert s.reward == pytest.approx(expected)  # the agent scored exactly what was trained
        assert s.info["agent/turns"] == 2 and s.info["agent/segments"] == 1
        assert sum(s.loss_mask) <= 12 and all(v == 0 for v, m in zip(s.versions, s.loss_mask,
                                                                      strict=True) if m)
    metrics = agent_metrics(group.samples)
    assert metrics["agent/turns"] == 2 and metrics["agent/tool_parse_failures"] == 0


def test_per_completion_rewards_with_discount(server, tiny_model_dir):
    wf = _workflow(tiny_model_dir, "per_turn", group_size=1, discount=0.5)
    (row,) = run_episode(server, wf, {"question": "7"}).samples
    turns = row.info["turns_log"]
    r = [float(len(t["completion"])) for t in turns]
    assert row.info["episode_return"] == pytest.approx(r[0] + 0.5 * r[1] + 0.25 * r[2])
    by_turn = {t: g for t, g in zip(row.info["turn_ids"], row.info["token_returns"], strict=True)
               if t >= 0}
    assert by_turn[2] == pytest.approx(r[2]) and by_turn[1] == pytest.approx(r[1] + 0.5 * r[2])


def test_a_failing_agent_drops_its_group_after_a_retry(server, tiny_model_dir):
    wf = _workflow(tiny_model_dir, "crash", group_size=2, retries=1)
    with pytest.raises(EpisodeError, match=r"group dropped: 2 of 2 episodes failed 2 times.*the agent broke"):
        run_episode(server, wf, {"question": "1"})


def test_the_turn_limit_fails_the_episode(server, tiny_model_dir):
    wf = _workflow(tiny_model_dir, "Looper", group_size=1, retries=0, max_turns=2)
    with pytest.raises(EpisodeError, match="turn limit reached"):
        run_episode(server, wf, {"question": "1"})


def test_a_malformed_agent_name_is_a_spec_error_naming_the_field():
    from training_core.config import SpecError, load_spec

    with pytest.raises(SpecError) as err:
        load_spec(None, ["rollout.workflow=agent:just_a_module"])
    assert "rollout.workflow" in err.value.errors


def test_an_agent_module_that_does_not_exist_is_named():
    from training_core.workflows.agent import agent_source

    with pytest.raises(ValueError, match="no file for module 'nowhere.agent'"):
        agent_source("nowhere.agent:run")
    source, entry = agent_source("examples/calculator_agent.py:run")
    assert entry == "run" and "def run(" in source


def test_agents_are_evaluated_by_a_greedy_episode_through_the_gateway(server, tiny_model_dir):
    import asyncio

    from training_core.evaluation import evaluate
    from training_core.transport.rollout_client import RolloutClient

    wf = _workflow(tiny_model_dir, "solved")
    wf.ctx.evaluate_episode = wf.aevaluate
    sent = []

    async def go():
        client = RolloutClient([server])
        real = client.agenerate

        async def recording(request):
            sent.append(request.sampling)
            return await real(request)

        client.agenerate = recording
        try:
            return await evaluate(client, wf.ctx, [{"question": "1+2="}, {"question": "2+2="}], 6)
        finally:
            await client.aclose()

    metrics = asyncio.run(go())
    assert metrics["eval/reward"] == 1.0 and metrics["eval/accuracy"] == 1.0
    assert len(sent) == 4 and all(s.greedy for s in sent)  # two greedy turns per episode
