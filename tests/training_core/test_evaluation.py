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


def test_every_statistic_of_an_eval_set_through_the_servers(server, tiny_model_dir):
    """Greedy accuracy, avg@k, pass@k and maj@k with their intervals, the weight version and the
    measured overlap, for rows whose answers are the server's own greedy completions."""
    import asyncio

    from training_core.api import SamplingParams
    from training_core.evaluation import evaluate_sets
    from training_core.metric_names import EVAL_HELDOUT as H
    from training_core.rewards.pool import RewardPool
    from training_core.transport.rollout_client import RolloutClient
    from training_core.workflows.base import WorkflowContext

    tok = load_tokenizer(tiny_model_dir)
    rows = []
    for i in range(4):
        row = {"question": f"{i}*{i}"}
        out = generate(server, render_prompt(tok, row, TEMPLATE, False), max_new_tokens=4,
                       temperature=0.0)
        rows.append({**row, "answer": tok.decode(out["output_ids"], skip_special_tokens=True)})
    ctx = WorkflowContext(tokenizer=tok, rewards=RewardPool("builtin:exact", executor="inline"),
                          sampling=SamplingParams(max_new_tokens=4, temperature=1.0),
                          group_size=1, prompt_template=TEMPLATE)

    async def run(**kw):
        client = RolloutClient([server], timeout_s=60)
        try:
            return await evaluate_sets(client, ctx, {"heldout": rows}, max_new_tokens=4,
                                       version=7, overlap={"heldout": 0.0}, **kw)
        finally:
            await client.aclose()

    m = asyncio.run(run(samples=3, k=2))
    assert m[H["greedy_accuracy"]] == 1.0 and m["eval/accuracy"] == 1.0
    assert m[H["version"]] == 7 and m[H["overlap_train_pool"]] == 0.0
    assert m[H["questions"]] == 4 and m[H["n"]] == 3 and m[H["k"]] == 2 and m[H["errors"]] == 0
    for name in ("greedy_accuracy", "avg@k", "pass@k", "maj@k"):
        assert 0 <= m[H[f"{name}_ci_lo"]] <= m[H[name]] <= m[H[f"{name}_ci_hi"]] <= 1, name
    # pass@2 is at least the one-sample accuracy (avg@k) on every question, so on their mean.
    assert m[H["pass@k"]] >= m[H["avg@k"]]
    # Greedy only: no sampled statistics.
    greedy = asyncio.run(run())
    assert H["avg@k"] not in greedy and greedy[H["greedy_accuracy"]] == 1.0


def test_an_agent_evaluates_its_own_greedy_episode_and_draws_no_samples(tiny_model_dir):
    """``ctx.evaluate_episode`` (agent workflows) is what scores each row, also in evaluate_sets."""
    import asyncio

    from training_core.api import SamplingParams
    from training_core.evaluation import evaluate, evaluate_sets
    from training_core.rewards.pool import RewardPool
    from training_core.workflows.base import WorkflowContext

    asked: list[str] = []

    async def episode(client, item):
        asked.append(item["question"])
        return 1.0 if item["question"] == "a" else 0.0

    ctx = WorkflowContext(tokenizer=load_tokenizer(tiny_model_dir),
                          rewards=RewardPool("builtin:exact", executor="inline"),
                          sampling=SamplingParams(max_new_tokens=4), group_size=1,
                          evaluate_episode=episode)
    rows = [{"question": q, "answer": "x"} for q in ("a", "b")]
    m = asyncio.run(evaluate_sets(None, ctx, {"tools": rows}, max_new_tokens=4, version=2,
                                  samples=4))
    assert m["eval/tools/greedy_accuracy"] == 0.5 and "eval/tools/avg@k" not in m
    assert sorted(asked) == ["a", "b"]  # one episode per row: no samples drawn
    assert asyncio.run(evaluate(None, ctx, rows, max_new_tokens=4))["eval/accuracy"] == 0.5


@pytest.mark.slow
def test_a_generator_run_above_10007_rows_reports_overlap_0_and_evaluates_its_final_version(
        tmp_path):
    """A real run (tiny model, embedded server, trainer) drawing 10,100 reasoning-gym rows, which
    seeds item i with seed + i (the old eval seed, seed + 10_007, made eval row j training row
    10_007 + j): its eval set shares no question with the training pool, it says so
    (eval/heldout/overlap_train_pool = 0), and each eval carries its version and statistics; the
    final version is evaluated although eval.every does not divide the step count."""
    from training_core import metric_names
    from training_core.metrics import read_metrics
    from training_core.train import train

    spec = load_spec(None, [
        "model.path=tiny", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
        "rollout.group_size=2", "trainer.batch_groups=2", "trainer.steps=3", "checkpoint.every=0",
        "data.source=reasoning_gym:basic_arithmetic", "data.size=10100",
        "data.options={max_terms: 2, max_digits: 1}", "eval.every=2", "eval.size=6",
        "eval.samples=2", "reward.fn=builtin:reasoning_gym", "reward.executor=inline",
        f"run_dir={tmp_path / 'run'}"])
    result = train(spec, progress=False)
    rows = read_metrics(result.run_dir)
    evals = {r["step"]: r for r in rows if metric_names.EVAL_HELDOUT["version"] in r}
    assert sorted(evals) == [0, 2, 3]  # before training, every 2 steps, and the final version
    H = metric_names.EVAL_HELDOUT
    assert [evals[s][H["version"]] for s in (0, 2, 3)] == [0, 2, 3]
    for row in evals.values():
        assert row[H["overlap_train_pool"]] == 0.0 and row[H["questions"]] == 6
        assert row[H["seen_in_trained_batch"]] == 0.0  # none of them came up in a batch
        assert 0 <= row[H["pass@k"]] <= 1 and row[H["n"]] == 2
    written = {k for r in rows for k in r} - metric_names.LINE_FIELDS
    assert written <= metric_names.DECLARED, sorted(written - metric_names.DECLARED)


@pytest.mark.slow
def test_oolong_eval_evaluates_a_stored_version_of_a_finished_run(tmp_path, capsys):
    """``oolong eval RUN_DIR``: the last stored version on the run's own eval set gives the
    greedy accuracy the run measured at that version through its server; another set that
    shares questions with the training pool is refused unless --allow-overlap says so."""
    import json

    from training_core import metric_names
    from training_core.cli import main
    from training_core.metrics import read_metrics
    from training_core.train import train

    spec = load_spec(None, [
        "model.path=tiny", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
        "rollout.group_size=2", "trainer.batch_groups=2", "trainer.steps=2", "checkpoint.every=0",
        "data.size=2000", "data.options={max_value: 9}", "eval.every=2", "eval.size=8",
        "reward.fn=builtin:arithmetic", "reward.executor=inline", f"run_dir={tmp_path / 'run'}"])
    run_dir = train(spec, progress=False).run_dir
    H = metric_names.EVAL_HELDOUT
    measured = next(r for r in read_metrics(run_dir) if r.get(H["version"]) == 2)

    out = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), "--samples", "3", "--k", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["version"] == 2 and result["set"] == "heldout"
    assert m[H["version"]] == 2 and m[H["questions"]] == 8 and m[H["overlap_train_pool"]] == 0
    assert m[H["greedy_accuracy"]] == measured[H["greedy_accuracy"]]
    assert m[H["n"]] == 3 and m[H["k"]] == 2 and 0 <= m[H["pass@k"]] <= 1

    # Questions of the run's 100-question space, most in its training pool: refused.
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    path = tmp_path / "train_like.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--data", f"jsonl:{path}"]) == 2
    assert "--allow-overlap" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "--data", f"jsonl:{path}", "--allow-overlap",
                 "--version", "0"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["set"] == "train_like" and other["version"] == 0
    # in the pool, but for those the run holds out in its own eval set
    assert other["metrics"]["eval/train_like/overlap_train_pool"] > 0.5
    assert main(["eval", str(run_dir), "--version", "7"]) == 2
    assert "no such weights" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluation_runs_beside_training_on_every_eval_set(tmp_path):
    """A real run (tiny model, embedded server, trainer) with a named eval set besides its own
    split, evaluated before training and after every step. Each evaluation is logged at the step
    it was taken at, on both sets, with the version of that step; none of the named set's
    questions reaches a training batch; and the trainer did not wait for the evaluations: the
    next push waited less (time/eval_wait_s) than each evaluation took (eval/seconds), since the
    next step's batch and update ran beside it (a loop that evaluated in line would wait all of
    it). ``oolong eval --name`` re-evaluates the named set of the finished run."""
    import json

    from training_core import metric_names as M
    from training_core.cli import main
    from training_core.data.datasets import load_data
    from training_core.metrics import read_metrics
    from training_core.train import train

    base = ["model.path=tiny", "rollout.max_new_tokens=8", "rollout.max_concurrent=8",
            "rollout.group_size=2", "trainer.batch_groups=2", "trainer.steps=3",
            "checkpoint.every=0", "data.size=2000", "data.options={max_value: 9}",
            "eval.every=1", "eval.size=6", "reward.fn=builtin:arithmetic",
            "reward.executor=inline", f"run_dir={tmp_path / 'run'}"]
    plain = load_spec(None, base)
    pool = sorted({r["question"] for r in load_data(plain.data, plain.seed).train})
    extra = [{"question": q, "answer": q} for q in pool[:8]]  # questions training would draw
    path = tmp_path / "extra.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in extra))
    spec = load_spec(None, [*base, f"eval.sets=[{{name: extra, source: 'jsonl:{path}', size: 8}}]"])
    result = train(spec, progress=False)
    rows = read_metrics(result.run_dir)

    X = {m: M.eval_set_metric("extra", m) for m in M.EVAL_SET_METRICS}
    H = M.EVAL_HELDOUT
    evals = {r["step"]: r for r in rows if H["version"] in r}
    assert sorted(evals) == [0, 1, 2, 3]
    for step, r in evals.items():
        assert r[H["version"]] == r[X["version"]] == step  # each step's weights
        assert r[X["questions"]] == 8 and r[H["questions"]] == 6
        assert r[X["overlap_train_pool"]] == 0.0 and r[X["seen_in_trained_batch"]] == 0.0
        assert r[M.EVAL_SECONDS] > 0
    lines = {r["step"]: r for r in rows if M.STEP_S in r}
    for step in (1, 2, 3):  # the push of step N waited for the evaluation of step N - 1
        assert lines[step][M.timer("eval_wait")] < evals[step - 1][M.EVAL_SECONDS]
    assert result.last_eval[H["version"]] == 3 and result.first_eval[H["version"]] == 0

    out = tmp_path / "extra-eval.json"
    assert main(["eval", str(result.run_dir), "--name", "extra", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["set"] == "extra" and again["version"] == 3
    assert again["metrics"][X["greedy_accuracy"]] == evals[3][X["greedy_accuracy"]]
    assert main(["eval", str(result.run_dir), "--name", "nope"]) == 2
