"""``oolong train`` with ``rollout.backend: sglang`` starts SGLang through the launcher.

SGLang cannot run on this machine (CUDA only), so its environment is a stand-in interpreter that
records what it was started with and exits as SGLang does without a GPU; the run must fail
naming it, after launching exactly the production command (the flags are checked against the
release in test_sglang_contract.py). ``nvidia-smi`` is a stand-in too, answering the memory
query the launcher makes, as the real one prints it."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from training_core import processes
from training_core.config import load_spec

FAKE_PYTHON = """#!/bin/sh
# SGLang's interpreter, stand-in: record argv and the environment, fail as SGLang does here.
SEEN_PATH="$PATH" python3 - "$@" <<'PY'
import json, os, sys
with open(os.environ["RECORD"], "a") as fh:
    fh.write(json.dumps({"argv": sys.argv[1:], "path": os.environ["SEEN_PATH"],
                         "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")
PY
echo "RuntimeError: No CUDA GPUs are available" >&2
exit 1
"""

FAKE_SMI = """#!/bin/sh
# nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i N (an 80 GB H100)
echo 81559
"""


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    python = _executable(tmp_path / "sglang-env" / "bin" / "python", FAKE_PYTHON)
    _executable(tmp_path / "tools" / "nvidia-smi", FAKE_SMI)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("OOLONG_SGLANG_PYTHON", str(python))
    monkeypatch.setenv("RECORD", str(record))
    monkeypatch.setenv("PATH", f"{tmp_path / 'tools'}{os.pathsep}{os.environ['PATH']}")
    # the stand-in's record file reaches it through the launcher's allow-list
    monkeypatch.setattr(processes, "ENV_ALLOW", processes.ENV_ALLOW | {"RECORD"})
    return record


def _recorded(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_oolong_train_launches_sglang_with_the_production_flags(fake_sglang, tiny_model_dir,
                                                                 tmp_path, monkeypatch):
    from training_core.run_setup import build_run

    monkeypatch.delenv("OOLONG_SERVER_KEY", raising=False)
    spec = load_spec(None, [f"model.path={tiny_model_dir}", "rollout.backend=sglang",
                            "model.dtype=bfloat16", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(RuntimeError, match=r"(?s)rollout server 0 exited with 1.*No CUDA GPUs"):
        build_run(spec)
    (call,) = _recorded(fake_sglang)
    argv = call["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"]
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert flag("--dtype") == "bfloat16" and flag("--weight-version") == "0"
    assert "--skip-tokenizer-init" in argv and flag("--host") == "127.0.0.1"
    key_file = Path(flag("--config"))
    assert key_file.parent == tmp_path / "run"
    assert key_file.read_text().startswith("api-key: ")
    # SGLang's own tools (flashinfer's ninja/nvcc) first on its PATH
    assert call["path"].split(os.pathsep)[0] == str(Path(os.environ["OOLONG_SGLANG_PYTHON"]).parent)


def test_a_shared_gpu_gets_a_memory_fraction_sized_for_the_trainer(fake_sglang, tiny_model_dir,
                                                                    tmp_path):
    """One GPU: the server shares it with the trainer, and takes what the trainer leaves of the
    80 GiB the (stand-in) nvidia-smi reports."""
    from training_core.launch import start_fleet

    spec = load_spec(None, [f"model.path={tiny_model_dir}", "rollout.backend=sglang"])
    with pytest.raises(RuntimeError, match="rollout server 0 exited"):
        start_fleet(spec, tiny_model_dir, tmp_path, seed=0, gpus=1, trainer_gpus=1,
                    server_key="k")
    (call,) = _recorded(fake_sglang)
    fraction = float(call["argv"][call["argv"].index("--mem-fraction-static") + 1])
    assert 0.5 < fraction <= 0.85 and call["gpus"] == "0"
    # two GPUs and one trainer rank: the server gets the second GPU to itself, no fraction
    fake_sglang.unlink()
    with pytest.raises(RuntimeError, match="rollout server 0 exited"):
        start_fleet(spec, tiny_model_dir, tmp_path, seed=0, gpus=2, trainer_gpus=1,
                    server_key="k")
    (call,) = _recorded(fake_sglang)
    assert "--mem-fraction-static" not in call["argv"] and call["gpus"] == "1"


def test_a_lora_run_launches_sglang_with_its_lora_arguments(fake_sglang, tiny_model_dir,
                                                             tmp_path, monkeypatch):
    """issue 49: ``oolong train``'s own SGLang for a LoRA run is started ready for the adapters
    the run loads as it trains (their rank and modules up front: none exists at launch)."""
    from training_core.run_setup import build_run

    monkeypatch.delenv("OOLONG_SERVER_KEY", raising=False)
    spec = load_spec(None, [f"model.path={tiny_model_dir}", "rollout.backend=sglang",
                            "model.lora.rank=8", "model.lora.target_modules=[q_proj, v_proj]",
                            f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(RuntimeError, match=r"(?s)rollout server 0 exited with 1"):
        build_run(spec)
    (call,) = _recorded(fake_sglang)
    argv = call["argv"]
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"
    start = argv.index("--lora-target-modules") + 1
    assert argv[start:start + 3] == ["q_proj", "v_proj", "--max-loras-per-batch"]
