"""The SGLang contract: the platform calls only routes of the pinned SGLang release, with the
bodies of that release's request models, and launches it with flags it has.

``fixtures/sglang_request_models.json`` holds the release's routes and request models; where the
release's source is at hand (see ``sglang_contract.release_source``) the fixture is re-derived
from it and must agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.training_core.sglang_contract import (
    ENDPOINTS,
    MODELS,
    SGLANG_VERSION,
    check_request,
    release_cli_flags,
    release_models,
    release_routes,
    release_source_or_skip,
)
from training_core.launch import sglang_server_command

ROOT = Path(__file__).resolve().parents[3]
# Everything that talks to a rollout server: the trainer's client and weight sync, and the
# orchestration that probes servers (the embedded server *serves* these routes; not a caller).
CALLERS = [ROOT / "training_core/transport/rollout_client.py", ROOT / "training_core/transport/weight_sync.py",
           ROOT / "training_core/launch.py", *sorted((ROOT / "platform/orchestration").rglob("*.py"))]
ROUTE = re.compile(r"""["'](/[a-z_]+)["']""")


def called_routes() -> dict[str, list[str]]:
    """Route -> where the platform names it (file:line)."""
    found: dict[str, list[str]] = {}
    for path in CALLERS:
        for no, line in enumerate(path.read_text().splitlines(), 1):
            for route in ROUTE.findall(line):
                found.setdefault(route, []).append(f"{path.relative_to(ROOT)}:{no}")
    return found


def test_the_sglang_extra_pins_the_release_the_contract_was_taken_from():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["sglang"] == [f"sglang=={SGLANG_VERSION}"]
    pins = [ln.split("#")[0].strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()
            if ln.strip().lower().startswith("sglang")]
    assert pins == [f"sglang=={SGLANG_VERSION}"]


def test_every_route_the_platform_calls_is_in_the_contract():
    routes = called_routes()
    # The scan sees the calls (a broken regex or a moved file would find nothing).
    assert {"/generate", "/server_info", "/model_info", "/health",
            "/update_weights_from_distributed", "/begin_weight_update"} <= set(routes)
    known = {key.split(" ", 1)[1] for key in ENDPOINTS}
    unknown = {r: where for r, where in routes.items() if r not in known}
    assert not unknown, f"routes not in SGLang {SGLANG_VERSION}'s contract: {unknown}"


def test_server_info_and_weight_update_brackets_take_what_the_platform_sends():
    assert check_request("GET", "/server_info", None) == []
    assert check_request("POST", "/begin_weight_update", {}) == []
    assert check_request("POST", "/end_weight_update", {}) == []
    # and the contract refuses what the release does not have
    assert check_request("GET", "/get_weight_version", None)
    assert check_request("POST", "/begin_weight_update", {"selector": "everything"})


@pytest.fixture(scope="module")
def source() -> Path:
    return release_source_or_skip()


def test_the_fixture_routes_are_the_releases(source):
    real = release_routes(source)
    for key, model in ENDPOINTS.items():
        assert key in real, f"{key} is not a route of SGLang {SGLANG_VERSION}"
        assert real[key] == model, f"{key} takes {real[key]} in the release, fixture says {model}"


def test_the_fixture_models_are_the_releases(source):
    real = release_models(source)
    for name, spec in MODELS.items():
        fields = real.get(name)
        assert fields, f"{name} is not a class of SGLang {SGLANG_VERSION}"
        extra = set(spec["fields"]) - set(fields)
        assert not extra, f"{name} has no fields {extra} in the release"
        required = {f for f, has_default in fields.items() if not has_default}
        assert set(spec["required"]) == required, (name, spec["required"], required)


def test_the_launch_flags_are_the_releases(source, tmp_path):
    cmd = sglang_server_command("/models/m", 30001, tp=2, dtype="bfloat16", mem_fraction=0.5,
                                config=tmp_path / "keys.yaml")
    flags = {a for a in cmd if a.startswith("--")}
    assert {"--tp-size", "--weight-version", "--mem-fraction-static", "--dtype",
            "--skip-tokenizer-init", "--config"} <= flags
    missing = flags - release_cli_flags(source)
    assert not missing, f"SGLang {SGLANG_VERSION} has no server flags {missing}"


def test_the_key_file_is_read_by_the_releases_config_merger(source, tmp_path):
    """The run's API keys reach SGLang through ``--config``: the release's own merger turns the
    file the launcher writes into ``--api-key``/``--admin-api-key``, which its parser knows."""
    import argparse
    import importlib.util

    from training_core.launch import sglang_key_file

    path = source / "sglang/srt/utils/server_args_config_parser.py"
    spec = importlib.util.spec_from_file_location("sglang_config_parser", path)
    merger_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merger_module)
    parser = argparse.ArgumentParser()
    for flag in ("--api-key", "--admin-api-key", "--config", "--port"):
        parser.add_argument(flag)
    merged = merger_module.ConfigArgumentMerger(parser).merge_config_with_args(
        ["--port", "30000", "--config", str(sglang_key_file(tmp_path, 0, "k3y"))])
    args = parser.parse_args(merged)
    assert (args.api_key, args.admin_api_key, args.port) == ("k3y", "k3y", "30000")
    assert {"--api-key", "--admin-api-key"} <= release_cli_flags(source)


def test_a_lora_runs_flags_are_the_releases_lora_arguments(source):
    """A LoRA run's SGLang (issue 49): the release's own parser reads the flags the launcher
    writes into the values the run needs, and the release's own check of its LoRA arguments
    (``check_lora_server_args``: no adapters at launch needs the rank and the modules) passes."""
    import argparse

    from tests.training_core.sglang_oracle import _compiled, lora_parser
    from training_core.config import SGLANG_LORA_TARGETS, load_spec
    from training_core.launch import SGLANG_LORAS_PER_BATCH, server_command

    parser, supported = lora_parser(source)
    assert set(SGLANG_LORA_TARGETS) <= set(supported)
    spec = load_spec(None, ["rollout.backend=sglang", "model.lora.rank=8",
                            "model.lora.target_modules=[self_attn.q_proj, v_proj, down_proj]"])
    cmd = server_command(spec, "/models/m", 30001, 0)
    assert set(a for a in cmd if a.startswith("--")) <= release_cli_flags(source)
    lora_args = cmd[cmd.index("--enable-lora"):]
    args = parser.parse_args(lora_args)
    assert args.enable_lora is True and args.max_lora_rank == 8
    assert args.lora_target_modules == ["q_proj", "v_proj", "down_proj"]
    assert args.max_loras_per_batch == SGLANG_LORAS_PER_BATCH and args.max_loaded_loras is None
    # the release's check, its own source, on what its parser made of the flags
    check = _compiled(source, "srt/arg_groups/lora_hook.py", "check_lora_server_args", {
        "resolving_view": lambda s: s, "Any": object,
        "declare_resolution": lambda s, _who, **kw: [setattr(s, k, v) for k, v in kw.items()],
        "check_lora_speculative_compatibility": lambda s: None,
        "check_lora_moe_runner_args": lambda s: None, "LoRARef": object,
        "logger": argparse.Namespace(warning=print, info=print)})
    check(args)
    assert args.lora_paths == [] and args.lora_target_modules == {"q_proj", "v_proj", "down_proj"}
    # and without the rank the release refuses to start (what the launcher must never omit)
    bare = parser.parse_args(["--enable-lora", "--lora-target-modules", "q_proj"])
    with pytest.raises(AssertionError, match="max-lora-rank"):
        check(bare)
    # a full fine-tuning run's SGLang has no LoRA flags
    assert "--enable-lora" not in server_command(load_spec(None, ["rollout.backend=sglang"]),
                                                 "/models/m", 30001, 0)
