"""Export round trip: a short real run on the tiny model, one of its versions written as a
Hugging Face folder, loaded by plain ``transformers`` in fp32 on CPU: its greedy answers to the
run's eval prompts are exactly those the run's own rollout server gives at that version."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests.training_core.conftest import generate, start_server
from tests.training_core.test_train_e2e import SMALL
from training_core.config import load_spec
from training_core.data.datasets import load_data
from training_core.export import ExportError, export_version, weight_sources
from training_core.models.loading import load_model
from training_core.workflows.base import render_prompt


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """Four asynchronous steps against one embedded server, checkpoints at steps 2 and 4; after
    the run that server still holds version 4: its greedy answers are the run's at v4."""
    from training_core.train import train

    tmp = tmp_path_factory.mktemp("export-run")
    fleet, url = start_server(tiny_model_dir, tmp / "server.log")
    try:
        spec = load_spec(None, SMALL + [
            f"run_dir={tmp / 'run'}", f"rollout.server_urls=[{url}]", "trainer.steps=4",
            "checkpoint.every=2", "eval.every=2", "rollout.max_staleness=1"])
        result = train(spec, progress=False)
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        rows = load_data(spec.data, spec.seed).eval[: spec.eval.size]
        prompts = [render_prompt(tok, r, spec.data.prompt_template, spec.data.chat_template)
                   for r in rows]
        served = [generate(url, p, max_new_tokens=spec.rollout.max_new_tokens,
                           temperature=0.0)["output_ids"] for p in prompts]
        held = httpx_version(url)
    finally:
        fleet.stop()
    return {"run_dir": result.run_dir, "spec": spec, "prompts": prompts, "served": served,
            "held": held, "final": result.final_version, "tmp": tmp}


def httpx_version(url: str) -> str:
    import httpx

    return httpx.get(url + "/model_info").json()["weight_version"]


def _greedy(folder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    answers = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=eos)[0, len(p):].tolist()
            answers.append(out)
    return answers


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def test_an_exported_version_gives_the_runs_greedy_answers_in_transformers(finished_run):
    run = finished_run
    assert run["held"] == str(run["final"]) == "4"
    out = run["tmp"] / "exported"
    result = export_version(run["run_dir"], "latest", out)
    assert (result.version, result.step, result.source) == (4, 4, "pushed")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json",
                 "README.md", "oolong.json"):
        assert (out / name).exists(), name

    # bit for bit the weights the server loaded for v4 (the tied lm_head is the embedding)
    pushed = load_file(str(run["run_dir"] / "weights" / "v4" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in pushed.items())

    answers = _greedy(out, run["prompts"], run["spec"].rollout.max_new_tokens)
    eos = AutoTokenizer.from_pretrained(out).eos_token_id
    assert [_until_eos(a, eos) for a in answers] == [_until_eos(s, eos) for s in run["served"]]
    # Control: the starting model answers otherwise, so equal answers say something.
    initial = export_version(run["run_dir"], 0, run["tmp"] / "initial")
    assert initial.source == "initial"
    start = _greedy(run["tmp"] / "initial", run["prompts"], run["spec"].rollout.max_new_tokens)
    assert [_until_eos(a, eos) for a in start] != [_until_eos(s, eos) for s in run["served"]]

    # The run's sampling travels as generate's defaults; the card names where it came from.
    gen = GenerationConfig.from_pretrained(out)
    assert gen.max_new_tokens == run["spec"].rollout.max_new_tokens and gen.do_sample
    card = (out / "README.md").read_text()
    assert "`tiny`" in card and "synthetic:arithmetic" in card
    assert "rewards_for_tests:digit_reward" in card and "`eval/accuracy`" in card
    assert "commit `" in card and "max_staleness: 1" in card
    assert "| `eval/heldout/greedy_accuracy` |" in card and " – " in card  # with its interval
    record = json.loads((out / "oolong.json").read_text())
    assert record["version"] == 4 and record["step"] == 4
    assert set(record["evaluation"]) >= {"eval/accuracy", "eval/reward"}


def test_a_version_only_a_checkpoint_holds_is_exported_from_its_fp32_weights(finished_run):
    run = finished_run
    sources = weight_sources(run["run_dir"])
    assert sources[2].kind == "checkpoint" and sources[4].kind == "pushed"
    assert 1 not in sources  # neither pushed (written over) nor checkpointed
    out = run["tmp"] / "v2"
    result = export_version(run["run_dir"], 2, out)
    assert (result.version, result.step, result.source) == (2, 2, "checkpoint")
    exported = load_file(str(out / "model.safetensors"))
    saved = torch.load(sources[2].path / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)["module"]
    assert set(exported) <= set(saved)
    for name, tensor in exported.items():
        assert torch.equal(tensor, saved[name]), name
    # and it is not version 4's
    v4 = load_model(run["tmp"] / "exported")
    assert any(not torch.equal(exported[n], p) for n, p in v4.state_dict().items() if n in exported)

    with pytest.raises(ExportError, match="--version 1: the run holds no weights") as err:
        export_version(run["run_dir"], 1, run["tmp"] / "v1")
    assert err.value.field == "version" and not (run["tmp"] / "v1").exists()


def test_a_zero3_checkpoint_gives_the_weights_its_version_served(tiny_model_dir, tmp_path):
    """ZeRO-3 keeps the weights in the optimizer's partitions: the export gathers them (DeepSpeed's
    zero_to_fp32, forced to weights-only loading) into exactly what the servers loaded."""
    import os

    from training_core.export import WeightSource, load_state
    from training_core.train import train

    spec = load_spec(None, SMALL + [f"run_dir={tmp_path / 'run'}", "trainer.steps=2",
                                    "checkpoint.every=1", "eval.every=0",
                                    "trainer.zero_stage=3"])
    run_dir = train(spec, progress=False).run_dir
    assert (run_dir / "checkpoints" / "step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists()
    state = load_state(WeightSource(2, "checkpoint", run_dir / "checkpoints" / "step2", 2))
    served = load_file(str(run_dir / "weights" / "v2" / "model.safetensors"))
    assert all(torch.equal(state[k], v) for k, v in served.items())
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the switch is put back
    with pytest.raises(ExportError, match="holds version 2, not 1"):
        load_state(WeightSource(1, "checkpoint", run_dir / "checkpoints" / "step2", 2))


def test_merge_is_refused_for_a_run_without_an_adapter(finished_run):
    with pytest.raises(ExportError, match="no model.lora") as refused:
        export_version(finished_run["run_dir"], "latest", finished_run["tmp"] / "merged",
                       merge=True)
    assert refused.value.field == "merge"
