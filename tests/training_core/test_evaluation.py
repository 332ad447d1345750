"""The two evaluations share prompt rendering and scoring: offline evaluation of a set of weights
must agree with what the rollout server generates greedily from the same weights."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from tests.training_core.conftest import generate
from training_core.config import load_spec
from training_core.models.loading import load_model, load_tokenizer
from training_core.offline_eval import evaluate_weights
from training_core.workflows.base import render_prompt

TEMPLATE = "Q: {question} A:"


def test_offline_evaluation_matches_the_servers_greedy_completions(server, tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    rows = []
    for i in range(8):
        row = {"question": f"{i}+{2 * i}"}
        ids = render_prompt(tok, row, TEMPLATE, chat_template=False)
        out = generate(server, ids, max_new_tokens=6, temperature=0.0)
        completion = tok.decode(out["output_ids"], skip_special_tokens=True).strip()
        if completion:  # the reward needs something to compare
            rows.append({**row, "answer": completion})
    assert len(rows) >= 4

    weights = tmp_path / "v0"
    weights.mkdir()
    state = {k: v.contiguous() for k, v in load_model(tiny_model_dir).state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(weights / "model.safetensors"))
    spec = load_spec(None, ["reward.fn=builtin:exact", "rollout.max_new_tokens=6",
                            f"data.prompt_template={TEMPLATE}"])
    metrics = evaluate_weights(spec, tiny_model_dir, weights, rows)
    assert metrics["offline_eval/accuracy"] == 1.0 and metrics["offline_eval/rows"] == len(rows)

    # Control: prompts rendered another way give other completions, so the check can fail.
    other = spec.model_copy(update={"data": spec.data.model_copy(update={"prompt_template": "{question}"})})
    assert evaluate_weights(other, tiny_model_dir, weights, rows)["offline_eval/accuracy"] < 1.0


def test_offline_evaluation_never_runs_user_reward_code(tiny_model_dir, tmp_path):
    spec = load_spec(None, ["reward.fn=tests.training_core.rewards_for_tests:digit_reward"])
    with pytest.raises(ValueError, match="built-in rewards only"):
        evaluate_weights(spec, tiny_model_dir, tmp_path, [{"question": "1", "answer": "1"}])


def test_an_eval_row_too_long_for_the_server_is_counted_not_fatal(server, tiny_model_dir):
    """One eval prompt longer than the model's context: the client refuses it by the servers' length rule, the
    evaluation scores the row 0 and counts it in eval/errors, and the other rows are scored."""
    import asyncio

    from training_core.api import SamplingParams
    from training_core.evaluation import evaluate
    from training_core.metric_names import EVAL_ERRORS
    from training_core.models.loading import load_model
    from training_core.rewards.pool import RewardPool
    from training_core.transport.rollout_client import RolloutClient
    from training_core.workflows.base import WorkflowContext

    tok = load_tokenizer(tiny_model_dir)
    context = load_model(tiny_model_dir).config.max_position_embeddings
    rows = []
    for i in range(3):  # answers the server really gives greedily: these rows score 1
        row = {"question": f"{i}+{i}"}
        out = generate(server, render_prompt(tok, row, TEMPLATE, False), max_new_tokens=4,
                       temperature=0.0)
        rows.append({**row, "answer": tok.decode(out["output_ids"], skip_special_tokens=True)})
    rows.append({"question": "1" * (context + 10), "answer": "2"})
    ctx = WorkflowContext(tokenizer=tok, rewards=RewardPool("builtin:exact", executor="inline"),
                          sampling=SamplingParams(max_new_tokens=4), group_size=1,
                          prompt_template=TEMPLATE)

    async def run():
        client = RolloutClient([server], timeout_s=60)
        try:
            return await evaluate(client, ctx, rows, max_new_tokens=4, errors=errors)
        finally:
            await client.aclose()

    errors: list[str] = []
    metrics = asyncio.run(run())
    assert metrics[EVAL_ERRORS] == 1.0
    # refused by the servers' own length rule (their max_req_input_len), named in the reason
    assert len(errors) == 1 and "PromptTooLong" in errors[0] and "max_req_input_len" in errors[0]
    # the failed row counts as wrong: 3 of 4 right, the denominator keeps every row
    assert metrics["eval/accuracy"] == pytest.approx(3 / 4)
