"""A LoRA run end to end on CPU (issue 49): the embedded server, the trainer with an adapter, a
KL preset whose reference is the base with the adapter off, adapter-only pushes, and a resume."""

from __future__ import annotations

import json

import httpx
import pytest
from safetensors.torch import load_file

from tests.training_core.conftest import start_server
from tests.training_core.test_train_e2e import SMALL
from training_core.config import load_spec
from training_core.metrics import read_metrics

LORA = [*SMALL, "model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=1e-2",
        "algorithm.preset=ppo_kl", "rollout.group_size=4", "eval.every=0", "checkpoint.every=1"]


@pytest.mark.parametrize("pause_mode", ["in_place", "abort"])
def test_a_lora_run_pushes_only_adapters_and_resumes(tiny_model_dir, tmp_path, pause_mode):
    """Both ways a push meets samples in flight: they go on under the new adapter (in_place),
    or come back and are sent again naming it (abort); each token keeps its version."""
    from training_core.train import train

    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    run_dir = tmp_path / "run"
    try:
        common = [*LORA, f"run_dir={run_dir}", f"rollout.server_urls=[{url}]",
                  f"rollout.pause_mode={pause_mode}", "rollout.max_staleness=1"]
        train(load_spec(None, [*common, "trainer.steps=2"]), progress=False)
        resumed = train(load_spec(None, [*common, "trainer.steps=3"]), resume_dir=run_dir,
                        progress=False)
        info = httpx.get(url + "/model_info").json()
        probe = httpx.post(url + "/generate", json={
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}, "lora_path": "v1"})
    finally:
        fleet.stop()
    assert resumed.last_step == 3
    steps = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tokens/consumed"] > 0 for r in steps)
    assert all(r["staleness/max"] <= 1 for r in steps)
    # every pushed version is an adapter folder, nothing of the full model
    folders = sorted(p for p in (run_dir / "weights").glob("v*") if p.is_dir())
    assert folders, "no weights pushed"
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                            "adapter_model.safetensors"]
        assert all(".lora_" in k for k in load_file(str(folder / "adapter_model.safetensors")))
    # the server holds the last version, and the older adapters were unloaded
    assert info["weight_version"] == "3"
    assert probe.status_code == 400 and "v1" in probe.json()["error"]["message"]
    kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").open()]
    assert "resumed" in kinds and kinds[-1] == "finished"


def test_a_lora_runs_export_gives_its_servers_greedy_answers_as_adapter_and_merged(
        tiny_model_dir, tmp_path):
    """Issue 49.3 for an adapter: the latest version exported in peft's layout (loaded with
    transformers + peft) and merged (plain transformers) gives exactly the greedy answers the
    run's own server gives at that version (fp32, CPU); a checkpointed version exports too."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.training_core.conftest import generate
    from training_core.data.datasets import load_data
    from training_core.export import export_version
    from training_core.models.loading import load_tokenizer
    from training_core.train import train
    from training_core.workflows.base import render_prompt

    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    run_dir = tmp_path / "run"
    try:
        spec = load_spec(None, [*LORA, f"run_dir={run_dir}", f"rollout.server_urls=[{url}]",
                                "trainer.steps=2", "checkpoint.every=1",
                                "reward.fn=builtin:arithmetic"])  # offline eval: built-ins only
        train(spec, progress=False)
        tok = load_tokenizer(tiny_model_dir)
        rows = load_data(spec.data, spec.seed).eval[:6]
        prompts = [render_prompt(tok, r, spec.data.prompt_template, spec.data.chat_template)
                   for r in rows]
        served = [generate(url, p, max_new_tokens=6, temperature=0.0)["output_ids"]
                  for p in prompts]  # the server answers with the adapter it loaded last: v2
    finally:
        fleet.stop()

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    assert export_version(run_dir, "latest", adapter_dir).version == 2
    assert (adapter_dir / "adapter_model.safetensors").exists()
    assert not (adapter_dir / "model.safetensors").exists()  # the adapter alone
    assert json.loads((adapter_dir / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(spec.model.path)
    export_version(run_dir, "latest", merged_dir, merge=True)
    assert (merged_dir / "model.safetensors").exists()

    def greedy(model) -> list[list[int]]:
        eos = tok.eos_token_id
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6,
                                     pad_token_id=eos)[0, len(p):].tolist()
                out.append(ids[: ids.index(eos) + 1] if eos in ids else ids)
        return out

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with_adapter = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    trimmed = [s[: s.index(tok.eos_token_id) + 1] if tok.eos_token_id in s else s for s in served]
    assert greedy(with_adapter) == trimmed
    assert greedy(merged) == trimmed
    # oolong eval of the pushed adapter (it used to load the adapter's tensors as base weights
    # and refuse them), and of the same version from its checkpoint: the same numbers.
    import shutil

    from training_core.eval_cli import stored_eval

    pushed = stored_eval(run_dir, version=2, limit=6)["metrics"]
    assert pushed["eval/heldout/version"] == 2

    # the same version from its checkpoint alone (the frozen base left out of it)
    shutil.rmtree(run_dir / "weights")
    assert stored_eval(run_dir, version=2, limit=6)["metrics"] == pushed
    from_checkpoint = export_version(run_dir, "latest", tmp_path / "ckpt", merge=True)
    assert (from_checkpoint.version, from_checkpoint.source) == (2, "checkpoint")
    restored = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    assert greedy(restored) == trimmed


def test_a_lora_run_over_the_weight_group_pushes_the_adapter_alone(tiny_model_dir, tmp_path):
    """weight_sync distributed with an adapter (gloo on CPU): the trainer and one embedded
    server, two processes; each push broadcasts the adapter's tensors and nothing else (the
    server counts the bytes it received), the server serves each version's adapter by name and
    unloads the older ones, a resume pushes its checkpoint's adapter again, and no weights
    folder is written."""
    from training_core.train import train

    fleet, url = start_server(tiny_model_dir, tmp_path / "server.log")
    run_dir = tmp_path / "run"
    common = [*LORA, f"run_dir={run_dir}", f"rollout.server_urls=[{url}]",
              "weight_sync=distributed"]
    try:
        train(load_spec(None, [*common, "trainer.steps=2"]), progress=False)
        # a resume pushes its checkpoint's adapter again under the name the server holds
        train(load_spec(None, [*common, "trainer.steps=3"]), resume_dir=run_dir, progress=False)
        info = httpx.get(url + "/server_info").json()
        probes = {name: httpx.post(url + "/generate", json={
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}, "lora_path": name})
            for name in ("v2", "v3")}
    finally:
        fleet.stop()
    steps = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["tokens/consumed"] > 0 for r in steps)
    assert info["weight_version"] == "3" and not (run_dir / "weights").exists()
    assert probes["v3"].status_code == 200 and probes["v2"].status_code == 400
    # the adapter's bytes, from the model's shapes: rank 4 on the 7 projections, fp32
    c = json.loads((tiny_model_dir / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    ins_outs = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    per_push = 4 * 4 * sum(i + o for i, o in ins_outs) * c["num_hidden_layers"]
    pushes = info["weight_group_updates_received"]
    assert pushes >= 4 and info["weight_group_bytes_received"] == per_push * pushes
    model_bytes = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    assert per_push < model_bytes / 10
