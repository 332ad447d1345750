"""Which version an export takes: the versions a run directory holds (served files, complete
checkpoints with a known version, the starting model), ``latest`` and ``best``, and the errors
that name the flag to change. No model is loaded: the choice is made before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training_core import cli
from training_core.checkpoint import COMPLETE
from training_core.config import dump_spec, load_spec
from training_core.export import (
    ExportError,
    export_version,
    recorded_evaluations,
    resolve_version,
    weight_sources,
)

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def _run_dir(tmp_path: Path, lines: list[dict], pushed=(5, 6), checkpoints=(2, 4, 7)) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    dump_spec(load_spec(None, ["model.path=tiny"]), run / "spec.yaml")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for v in pushed:
        (run / "weights" / f"v{v}").mkdir(parents=True)
        (run / "weights" / f"v{v}" / "model.safetensors").write_bytes(b"x")
    for step in checkpoints:
        (run / "checkpoints" / f"step{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step{step}" / COMPLETE).write_text("ok")
    (run / "checkpoints" / "step8").mkdir()  # interrupted: no marker, never a source
    return run


# One update was refused at step 3, so from there a step's version is one behind its number.
LINES = [{"step": 0, "version": 0, "eval/accuracy": 0.2},
         {"step": 1, "version": 1}, {"step": 2, "version": 2, "eval/accuracy": 0.6},
         {"step": 4, "version": 3, "eval/accuracy": 0.6}, {"step": 5, "version": 4},
         {"step": 6, "version": 5}, {"step": 7, "version": 6, "eval/accuracy": 0.4}]


def test_the_held_versions_come_from_served_files_checkpoints_and_the_start(tmp_path):
    run = _run_dir(tmp_path, LINES)
    sources = weight_sources(run)
    assert {v: s.kind for v, s in sources.items()} == {
        0: "initial", 2: "checkpoint", 3: "checkpoint", 5: "pushed", 6: "pushed"}
    # a checkpoint's version is its step's metrics line's, not its step number
    assert sources[3].step == 4 and sources[3].path.name == "step4"
    assert sources[6].step == 7  # the served file wins over step 7's checkpoint


def test_latest_best_and_numbers(tmp_path):
    run = _run_dir(tmp_path, LINES)
    sources, evals = weight_sources(run), recorded_evaluations(run)
    assert resolve_version("latest", sources, evals) == 6
    assert resolve_version("best", sources, evals) == 3  # 0.6 at v2 and v3: the newer
    assert resolve_version("2", sources, evals) == 2
    # the best evaluation's weights are gone: the best of those held
    assert resolve_version("best", {k: sources[k] for k in (0, 6)}, evals) == 6
    with pytest.raises(ExportError, match="--version 4: the run holds no weights") as err:
        resolve_version(4, sources, evals)
    assert err.value.field == "version"
    with pytest.raises(ExportError, match="a version number, 'latest' or 'best'"):
        resolve_version("newest", sources, evals)
    with pytest.raises(ExportError, match="evaluated versions \\[2, 3, 6\\] are no longer held"):
        resolve_version("best", {k: sources[k] for k in (0, 5)},
                        {k: v for k, v in evals.items() if k != 5} | {0: {}})


def test_best_without_an_evaluation_names_the_flag(tmp_path, capsys):
    run = _run_dir(tmp_path, [{"step": 1, "version": 1}, {"step": 2, "version": 2}])
    with pytest.raises(ExportError, match="--version best: no held-out evaluation"):
        export_version(run, "best", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert cli.main(["export", str(run), "--version", "best", "--out", str(tmp_path / "o")]) == 2
    assert "--version best: no held-out evaluation" in capsys.readouterr().err


def test_an_existing_folder_or_a_missing_run_is_refused(tmp_path):
    run = _run_dir(tmp_path, LINES)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(ExportError, match="--out .*already exists") as err:
        export_version(run, "latest", tmp_path / "taken")
    assert err.value.field == "out" and (tmp_path / "taken" / "x").read_text() == "mine"
    with pytest.raises(ExportError, match="no spec.yaml there") as err:
        export_version(tmp_path / "nowhere", "latest", tmp_path / "out")
    assert err.value.field == "run"


def test_a_version_retired_while_it_is_read_is_refused(tmp_path, monkeypatch):
    """The disk sync retires a version by renaming its folder to weights/.spare and writing the
    next version over that file: an export that read it meanwhile must not pass it off."""
    import safetensors.torch
    import torch

    from training_core.export import WeightSource, load_state

    folder = tmp_path / "weights" / "v5"
    folder.mkdir(parents=True)
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    real = safetensors.torch.load_file

    def read_while_the_trainer_pushes(path, *a, **k):
        out = real(path, *a, **k)
        folder.rename(tmp_path / "weights" / ".spare")  # what DiskSync.push does two versions on
        folder.mkdir()
        safetensors.torch.save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"))
        return out

    source = WeightSource(5, "pushed", folder, 5)
    assert torch.equal(load_state(source)["w"], torch.zeros(2))  # undisturbed: read as it is
    monkeypatch.setattr(safetensors.torch, "load_file", read_while_the_trainer_pushes)
    with pytest.raises(ExportError, match="version 5 was retired by the running trainer"):
        load_state(source)


def test_an_evaluation_counts_at_the_version_it_records(tmp_path):
    """issue 48's harness records the version each evaluation was taken at; it wins over the
    line's own version, and the card shows each metric with its interval."""
    from training_core.export import _evaluation_rows

    run = _run_dir(tmp_path, LINES + [{"step": 8, "version": 7, "eval/heldout/version": 6,
                                       "eval/heldout/greedy_accuracy": 0.9,
                                       "eval/heldout/greedy_accuracy_ci_lo": 0.6,
                                       "eval/heldout/greedy_accuracy_ci_hi": 0.98}])
    evals = recorded_evaluations(run)
    assert evals[6]["eval/heldout/greedy_accuracy"] == 0.9 and 7 not in evals
    assert evals[6]["eval/accuracy"] == 0.4  # step 7's line, version 6
    assert _evaluation_rows(evals[6]) == ["| `eval/accuracy` | 0.4 |  |",
                                          "| `eval/heldout/greedy_accuracy` | 0.9 | 0.6 – 0.98 |"]
