"""The spec side of the mismatch work: where the proximal shortcut applies, and the
rollout_correction block's validation and resolution."""

from __future__ import annotations

import pytest

from training_core.algorithms.correction import CorrectionConfig
from training_core.algorithms.loss import resolve_correction
from training_core.algorithms.presets import resolve_algorithm
from training_core.config import SpecError, load_spec

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


@pytest.mark.parametrize(("overrides", "mode"), [
    ([], "stale"),  # the embedded engine in fp32: the server computes the trainer's numbers
    (["model.dtype=bfloat16"], "always"),  # bf16 kernels differ between server and trainer
    (["model.dtype=float16"], "always"),
    (["rollout.backend=sglang", "rollout.server_urls=[http://10.0.0.1:30000]"], "always"),
    (["rollout.backend=sglang"], "always"),
    (["rollout.server_urls=[http://127.0.0.1:9]"], "stale"),  # embedded servers placed elsewhere
    (["rollout.backend=sglang", "trainer.recompute_proximal=stale"], "stale"),  # said explicitly
    (["trainer.recompute_proximal=never"], "never"),
    (["trainer.recompute_proximal=always"], "always"),
])
def test_recompute_proximal_auto_takes_the_shortcut_only_where_exact(overrides, mode):
    spec = load_spec(None, overrides)
    assert spec.recompute_proximal_mode == mode


def test_recompute_proximal_defaults_to_auto_and_old_booleans_still_read():
    assert load_spec(None, []).trainer.recompute_proximal == "auto"
    assert load_spec(None, ["trainer.recompute_proximal=true"]).recompute_proximal_mode == "always"


def test_the_default_correction_is_the_presets_cap():
    for preset in ("grpo", "dapo"):
        spec = load_spec(None, [f"algorithm.preset={preset}"])
        algo = resolve_algorithm(preset)
        assert resolve_correction(spec.algorithm.rollout_correction, algo) == CorrectionConfig(
            token_mode="mask", token_high=algo.behav_weight_cap)
    spec = load_spec(None, ["algorithm.behav_weight_mode=clip", "algorithm.behav_weight_cap=2"])
    algo = resolve_algorithm("grpo", behav_weight_mode="clip", behav_weight_cap=2.0)
    got = resolve_correction(spec.algorithm.rollout_correction, algo)
    assert (got.token_mode, got.token_high) == ("truncate", 2.0)


def test_a_correction_block_resolves_every_rule():
    spec = load_spec(None, [
        "algorithm.rollout_correction.token_mode=truncate",
        "algorithm.rollout_correction.token_low=0.5", "algorithm.rollout_correction.token_high=2",
        "algorithm.rollout_correction.sequence_mode=geometric",
        "algorithm.rollout_correction.sequence_high=1.25",
        "algorithm.rollout_correction.opsm_delta=0.1"])
    got = resolve_correction(spec.algorithm.rollout_correction, resolve_algorithm("grpo"))
    assert got == CorrectionConfig(token_mode="truncate", token_low=0.5, token_high=2.0,
                                   sequence_mode="geometric", sequence_low=0.8,
                                   sequence_high=1.25, opsm_delta=0.1)


@pytest.mark.parametrize(("override", "key"), [
    ("algorithm.rollout_correction.token_mode=cap", "algorithm.rollout_correction.token_mode"),
    ("algorithm.rollout_correction.sequence_high=0.9",
     "algorithm.rollout_correction.sequence_high"),
    ("algorithm.rollout_correction.opsm_delta=-1", "algorithm.rollout_correction.opsm_delta"),
    ("algorithm.rollout_correction.token_low=-0.1", "algorithm.rollout_correction.token_low"),
])
def test_bad_correction_values_name_their_key(override, key):
    with pytest.raises(SpecError) as err:
        load_spec(None, [override])
    assert key in err.value.errors


def test_crossed_bounds_are_refused_with_the_fields_named():
    with pytest.raises(SpecError, match="token_low .* must be below token_high"):
        load_spec(None, ["algorithm.rollout_correction.token_low=3",
                         "algorithm.rollout_correction.token_high=2"])
    with pytest.raises(SpecError, match="sequence_low"):
        load_spec(None, ["algorithm.rollout_correction.sequence_low=1.5"])
