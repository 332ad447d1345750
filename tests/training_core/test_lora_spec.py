"""``model.lora`` in the run spec (issue 49.1): empty is full fine-tuning, a mapping turns an
adapter on with Llama/Qwen defaults, and every bad value names its field."""

from __future__ import annotations

import pytest

from training_core.config import LORA_TARGETS_DEFAULT, SpecError, load_spec


def test_absent_is_full_fine_tuning_and_an_empty_mapping_takes_the_defaults():
    assert load_spec(None, []).model.lora is None
    assert load_spec(None, ["model.lora=null"]).model.lora is None
    lora = load_spec(None, ["model.lora={}"]).model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.0)
    assert tuple(lora.target_modules) == LORA_TARGETS_DEFAULT
    assert load_spec(None, ["model.lora.target_modules=[q_proj, q_proj, v_proj]"]
                     ).model.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("override, field, words", [
    ("model.lora.rank=0", "model.lora.rank", "greater than or equal to 1"),
    ("model.lora.alpha=0", "model.lora.alpha", "greater than 0"),
    ("model.lora.dropout=1", "model.lora.dropout", "less than 1"),
    ("model.lora.target_modules=[]", "model.lora.target_modules", "at least one linear layer"),
    ("model.lora.target_modules=['q proj']", "model.lora.target_modules", "not a module name"),
    ("model.lora.rnk=4", "model.lora.rnk", "Did you mean 'model.lora.rank'"),
])
def test_a_bad_value_names_its_field(override, field, words):
    with pytest.raises(SpecError) as exc:
        load_spec(None, [override])
    assert field in exc.value.errors and words in exc.value.errors[field]


@pytest.mark.parametrize("overrides, field, words", [
    (["rollout.backend=sglang", "weight_sync=distributed"], "weight_sync: disk",
     "no route that loads an adapter over the weight update group"),
    (["rollout.backend=sglang", "model.lora.target_modules=[q_proj, mlp.fc1]"],
     "model.lora.target_modules", "cannot serve an adapter on mlp.fc1"),
    (["trainer.zero_stage=3"], "trainer.zero_stage 3", "a few MB"),
])
def test_what_does_not_work_for_adapters_is_refused_naming_the_field(overrides, field, words):
    with pytest.raises(SpecError) as exc:
        load_spec(None, ["model.lora.rank=8", *overrides])
    assert field in str(exc.value) and words in str(exc.value)
    load_spec(None, [o for o in overrides if "lora" not in o])  # without an adapter it is fine


def test_the_embedded_server_takes_adapters_over_both_syncs():
    for sync in ("disk", "distributed"):
        assert load_spec(None, ["model.lora.rank=8", f"weight_sync={sync}"]).weight_sync == sync


def test_sglang_serves_adapters_pushed_over_disk():
    spec = load_spec(None, ["model.lora.rank=8", "rollout.backend=sglang", "weight_sync=disk",
                            "model.lora.target_modules=[self_attn.q_proj, v_proj]"])
    assert spec.model.lora.rank == 8 and spec.rollout.backend == "sglang"
