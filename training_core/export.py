"""Getting a trained model out: one policy version of a run as a Hugging Face folder.

A run keeps a version's weights in one of three places (:func:`weight_sources`):

- ``weights/v<N>/model.safetensors``: what the rollout servers loaded for version N, in the
  dtype they served (the disk sync keeps the last two versions; the others are written over);
- ``checkpoints/step<S>/``: the trainer's DeepSpeed checkpoint of step S, whose version the
  step's metrics line names (``metrics.jsonl``); its fp32 weights, checked against the version
  the checkpoint itself recorded when it is read;
- version 0 is the run's starting model (``initial_model`` or ``model.path``).

:func:`export_version` writes the chosen version as a folder ``transformers`` loads as it is:
``model.safetensors`` and ``config.json`` in the run's dtype, the tokenizer with its chat
template, a ``generation_config.json`` with the run's sampling, ``oolong.json`` (the lineage as
data) and a model card, ``README.md``. The folder is written beside ``out`` and renamed into
place, so it is whole or absent. A LoRA run (``model.lora``) keeps only its adapter per version
(``weights/v<N>/adapter_model.safetensors``, a checkpoint without the frozen base): its export is
the adapter in peft's layout (``adapter_model.safetensors``, ``adapter_config.json``, what
``PeftModel.from_pretrained`` and SGLang's ``--lora-paths`` take) beside the tokenizer and card,
or with ``merge`` the base with the adapter merged in, a plain model. Nothing here imports the web app: it passes what only it knows
(dataset and reward versions, the tracker's evaluations) as ``lineage`` and ``evaluations``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training_core import __version__, metric_names
from training_core.checkpoint import checkpoint_dir, complete_checkpoints, pushed_weights
from training_core.config import RunSpec, load_spec
from training_core.metrics import read_metrics
from training_core.trainer.adapter import ADAPTER_FILE

ROOT = Path(__file__).resolve().parents[1]
LINEAGE_FILE = "oolong.json"
SELECTORS = ("latest", "best")
# The held-out metric `best` ranks by (greedy accuracy on the run's eval rows).
BEST_BY = metric_names.EVAL_ACCURACY


class ExportError(ValueError):
    """A request that cannot be exported as asked; ``field`` names what to change."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class WeightSource:
    version: int
    kind: str  # "pushed" | "checkpoint" | "initial"
    path: Path
    step: int | None = None  # the training step that produced it (None: not known)


@dataclass
class ExportResult:
    out: Path
    version: int
    step: int | None
    source: str
    evaluation: dict[str, float] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)


# ---- which versions a run holds ------------------------------------------------------------------

def step_versions(run_dir: str | Path) -> dict[int, int]:
    """step -> the policy version after it, from ``metrics.jsonl`` (step 0: version 0)."""
    return {int(r["step"]): int(r["version"]) for r in read_metrics(run_dir)
            if "step" in r and "version" in r}


def weight_sources(run_dir: str | Path) -> dict[int, WeightSource]:
    """Every version whose weights the run directory still holds, newest source preferred:
    the served file over a checkpoint (it is exactly what the servers answered with)."""
    run_dir = Path(run_dir)
    versions = step_versions(run_dir)
    step_of = {v: s for s, v in sorted(versions.items())}  # a version's last step
    found = {0: WeightSource(0, "initial", run_dir, 0)}
    for step, tag in complete_checkpoints(run_dir):
        if step in versions:  # a checkpoint without its metrics line has no known version
            v = versions[step]
            found[v] = WeightSource(v, "checkpoint", checkpoint_dir(run_dir) / tag, step)
    for v, folder in pushed_weights(run_dir):
        found[v] = WeightSource(v, "pushed", folder, step_of.get(v))
    return dict(sorted(found.items()))


# The version an evaluation was taken at, as the evaluation itself records it (else the line's).
EVAL_VERSION = metric_names.EVAL_HELDOUT["version"]


def recorded_evaluations(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """version -> the held-out evaluation metrics (``eval/*``, intervals included) recorded at it
    in metrics.jsonl."""
    out: dict[int, dict[str, float]] = {}
    for r in read_metrics(run_dir):
        evals = {k: v for k, v in r.items() if k.startswith("eval/") and isinstance(v, int | float)}
        version = evals.get(EVAL_VERSION, r.get("version"))
        if evals and version is not None:
            out.setdefault(int(version), {}).update(evals)
    return out


def resolve_version(selector: int | str, sources: dict[int, WeightSource],
                    evaluations: dict[int, dict[str, float]]) -> int:
    """``latest`` (the newest version held), ``best`` (the best held-out greedy accuracy among
    the versions held; a tie goes to the newer version) or a version number."""
    held = sorted(sources)
    if selector == "latest":
        return held[-1]
    if selector == "best":
        scored = {v: e[BEST_BY] for v, e in evaluations.items() if BEST_BY in e}
        if not scored:
            raise ExportError(f"--version best: no held-out evaluation ({BEST_BY}) is recorded "
                              "for this run (eval.every was 0, or no eval rows); give a version "
                              "number or 'latest'", field="version")
        candidates = [v for v in held if v in scored]
        if not candidates:
            raise ExportError(f"--version best: the evaluated versions {sorted(scored)} are no "
                              f"longer held (weights held: {held}); give one of those",
                              field="version")
        return max(candidates, key=lambda v: (scored[v], v))
    try:
        version = int(selector)
    except (TypeError, ValueError):
        raise ExportError(f"--version {selector!r}: a version number, 'latest' or 'best'",
                          field="version") from None
    if version not in sources:
        raise ExportError(f"--version {version}: the run holds no weights of that version "
                          f"(held: {held}; pushed weights keep the last two versions, "
                          "checkpoint.keep the newest checkpoints)", field="version")
    return version


# ---- reading a version's weights -----------------------------------------------------------------

def load_state(source: WeightSource) -> dict[str, Any] | None:
    """The version's tensors by parameter name; None for the starting model (nothing to apply)."""
    if source.kind == "initial":
        return None
    if source.kind == "pushed":
        from safetensors.torch import load_file

        # A live run retires a version two pushes later by renaming its folder and writing the
        # next version over it: the file must be the same one after it was read.
        path = source.path / "model.safetensors"
        if not path.exists() and (source.path / ADAPTER_FILE).exists():
            path = source.path / ADAPTER_FILE  # a LoRA run's version: the adapter alone
        before = _identity(path)
        state = load_file(str(path))
        if before is None or _identity(path) != before:
            raise ExportError(f"version {source.version} was retired by the running trainer while "
                              "it was read; export a newer or a checkpointed version",
                              field="version")
        return state
    return _checkpoint_state(source)


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


# DeepSpeed names the file holding the module and the client state by the ZeRO stage.
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# torch's switch that makes every torch.load weights-only, even one asking otherwise.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def _checkpoint_state(source: WeightSource) -> dict[str, Any]:
    """The fp32 weights of a DeepSpeed checkpoint. Every file is read with ``weights_only``
    (tensors, containers and the few classes the trainer's checkpoints hold): a checkpoint written
    on a node must not run code in the process that exports it."""
    import torch

    path = next((source.path / n for n in MODEL_STATES if (source.path / n).exists()), None)
    if path is None:
        raise ExportError(f"checkpoint {source.path} has none of {', '.join(MODEL_STATES)}",
                          field="version")
    with _weights_only():
        saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("version") != source.version:
        raise ExportError(f"checkpoint {source.path} holds version {saved.get('version')}, "
                          f"not {source.version} as metrics.jsonl says", field="version")
    module = saved.get("module") or {}
    if not module or any(t.numel() == 0 for t in module.values()):
        # ZeRO-3 keeps the weights in the optimizer's partitions; DeepSpeed gathers them (its
        # loader asks for full unpickling: the environment switch below overrides it).
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with _weights_only(force=True):
            module = get_fp32_state_dict_from_zero_checkpoint(str(source.path.parent),
                                                              tag=source.path.name)
    return dict(module)


@contextmanager
def _weights_only(*, force: bool = False) -> Iterator[None]:
    """``torch.load`` restricted to tensors and these globals; ``force``: also for callers that
    pass ``weights_only=False`` (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, read at each load)."""
    import numpy as np
    import torch

    allowed: list[Any] = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                          type(np.dtype("uint32"))]
    try:  # what a ZeRO optimizer's state file holds besides tensors
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum

        allowed += [LossScaler, ZeroStageEnum]
    except ImportError:
        pass
    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    if force:
        os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        if force:
            if before is None:
                os.environ.pop(FORCE_WEIGHTS_ONLY, None)
            else:
                os.environ[FORCE_WEIGHTS_ONLY] = before


# ---- a run whose files are on another node: its durable checkpoint store ---------------------

def stage_from_store(store: Any, spec: RunSpec, version: int | str, dest: str | Path, *,
                     step_versions: dict[int, int],
                     evaluations: dict[int, dict[str, float]] | None = None) -> Path:
    """A run directory at ``dest`` holding what :func:`export_version` reads, made from the
    run's durable checkpoint store (``training_core.checkpoint_store``) where its own directory
    is on another node: the spec, the checkpoint of the asked version (``latest``: the newest
    the store holds; ``best``: the best evaluated one it holds), the warm-started starting model
    where the store has it, and a ``metrics.jsonl`` of the steps' versions. ``step_versions``
    (step -> version) and ``evaluations`` are the caller's record of the run (the web app's
    tracker): the store keeps checkpoints, not metrics. Refused, naming what is missing, when
    the store holds no checkpoint of a known version."""
    from training_core.config import dump_spec

    dest = Path(dest)
    held = {step_versions[step]: (step, tag) for step, tag in store.complete()
            if step in step_versions}
    if not held:
        raise ExportError(
            f"run: its files are on another node and the checkpoint store {store.url} holds no "
            f"complete checkpoint of it with a known version (checkpoints there: "
            f"{[t for _, t in store.complete()] or 'none'}); checkpoint.every > 0 makes them, "
            "or export on the node that ran it", field="run")
    sources = {v: WeightSource(v, "checkpoint", Path(tag), step) for v, (step, tag) in held.items()}
    v = resolve_version(version, sources, evaluations or {})
    step, tag = held[v]
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    dump_spec(spec, dest / "spec.yaml")
    (dest / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "version": sv}) + "\n" for s, sv in sorted(step_versions.items())))
    store.download(tag, checkpoint_dir(dest))
    if store.has_initial_model():  # a warm-started run starts from it, not model.path
        store.download_initial_model(dest / "initial_model")
    return dest


# ---- writing the folder ------------------------------------------------------------------------

def export_version(run_dir: str | Path, version: int | str, out: str | Path, *,
                   lineage: dict[str, Any] | None = None,
                   evaluations: dict[int, dict[str, float]] | None = None,
                   merge: bool = False) -> ExportResult:
    """Write ``version`` of the run in ``run_dir`` to the new folder ``out`` (see the module
    doc). ``evaluations`` (version -> metrics) replaces metrics.jsonl's where the caller holds
    the record (the web app's tracker); ``lineage`` adds what the run directory does not know.
    ``merge``: a LoRA run's adapter merged into its base (else the adapter alone, peft's
    layout); refused for a run without an adapter, which has nothing to merge."""
    from training_core.dtypes import precision, torch_dtype
    from training_core.models.loading import load_model, load_tokenizer
    from training_core.models.paths import run_model_dir

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "spec.yaml").exists():
        raise ExportError(f"{run_dir}: no spec.yaml there (is it a run directory?)", field="run")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: already exists and is not an empty folder; choose a "
                          "new one", field="out")
    spec = load_spec(run_dir / "spec.yaml")
    sources = weight_sources(run_dir)
    evaluations = recorded_evaluations(run_dir) if evaluations is None else evaluations
    v = resolve_version(version, sources, evaluations)
    source = sources[v]
    model_dir = run_model_dir(spec, run_dir)

    # Loaded as the trainer holds its weights (a bf16 run: fp32 masters), then cast to the
    # served dtype: the exact values the servers held.
    if merge and spec.model.lora is None:
        raise ExportError("--merge: this run trained full weights (no model.lora), there is no "
                          "adapter to merge; export without --merge", field="merge")
    model = load_model(model_dir, precision(spec.model.dtype).trainer_weights)
    state = load_state(source)
    if spec.model.lora is not None:
        model = _with_adapter(model, spec, state, source)
        if merge:
            model = model.merge_and_unload()
    elif state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
            raise ExportError(f"the weights of version {v} ({source.path}) do not fit the run's "
                              f"model {model_dir}: missing {sorted(missing)[:5]}, unexpected "
                              f"{sorted(unexpected)[:5]}", field="version")
        if tied:
            model.tie_weights()
    model = model.to(torch_dtype(spec.model.dtype))
    model.config.use_cache = True

    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if spec.model.lora is not None and not merge:  # the adapter names its base as the spec does
            _name_the_base(tmp, spec)
        load_tokenizer(model_dir).save_pretrained(tmp)  # with its chat template
        generation_config(spec, model).save_pretrained(tmp)
        record = lineage_record(spec, run_dir, source, evaluations.get(v, {}), model_dir,
                                lineage or {})
        (tmp / LINEAGE_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(record))
        mode = (tmp / "README.md").stat().st_mode & 0o777  # the umask's, for every file:
        for f in tmp.iterdir():  # transformers writes the weights through a 0600 temp file
            f.chmod(mode)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, v, source.step, source.kind, record["evaluation"], record)


def _with_adapter(model: Any, spec: RunSpec, state: dict[str, Any] | None,
                  source: WeightSource) -> Any:
    """The base wrapped with the run's adapter (as the trainer wraps it) holding ``source``'s
    adapter weights; version 0's adapter is the untrained one (it changes nothing)."""
    from peft import set_peft_model_state_dict

    from training_core.trainer.adapter import wrap

    model = wrap(model, spec.model.lora)
    if state is None:
        return model
    if source.kind == "pushed":  # peft's file: keys without the adapter's name
        result = set_peft_model_state_dict(model, state)
        unexpected = list(result.unexpected_keys)
    else:  # a checkpoint: the trained module's own names (the frozen base left out)
        _, unexpected = model.load_state_dict(state, strict=False)
        unexpected = [k for k in unexpected if not k.endswith("lm_head.weight")]  # tied alias
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    loaded = {k.replace(".weight", ".default.weight") if ".default." not in k else k
              for k in state if "lora_" in k}
    if unexpected or not lora <= {_full_name(k) for k in loaded}:
        raise ExportError(f"the adapter of version {source.version} ({source.path}) does not fit "
                          f"the run's model.lora: unexpected {sorted(unexpected)[:5]}",
                          field="version")
    return model


def _full_name(key: str) -> str:
    """A state dict key as the wrapped model names its parameter."""
    return key if key.startswith("base_model.") else f"base_model.model.{key}"


def _name_the_base(folder: Path, spec: RunSpec) -> None:
    """peft writes the base model's local folder into adapter_config.json; the export names it
    as the run's spec did (``tiny``, ``smollm2`` or a Hugging Face name), which a user can load."""
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(spec.model.path)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def generation_config(spec: RunSpec, model: Any) -> Any:
    """The run's sampling as ``generate`` defaults (RL sampled at these; greedy evaluation is
    ``do_sample=False``). top_k 0 is transformers' "off", the spec's is -1."""
    from transformers import GenerationConfig

    r = spec.rollout
    gen = GenerationConfig.from_model_config(model.config)
    gen.max_new_tokens = r.max_new_tokens
    gen.do_sample = r.temperature > 0
    if gen.do_sample:
        gen.temperature, gen.top_p, gen.top_k = r.temperature, r.top_p, max(r.top_k, 0)
    return gen


def code_version() -> dict[str, str]:
    """The package version, and the git commit of this checkout where there is one."""
    out = {"oolong": __version__}
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        out["commit"] = commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass  # an installed package without its repository
    return out


def lineage_record(spec: RunSpec, run_dir: Path, source: WeightSource, evaluation: dict[str, float],
                   model_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    warm = (run_dir / "initial_model" / "config.json").exists()
    extra = dict(extra)  # the caller's stays as it was
    return {
        "run": {"name": spec.name, "dir": str(run_dir.resolve()), **extra.pop("run", {})},
        "version": source.version,
        "step": source.step,
        "source": {k: str(v) for k, v in asdict(source).items() if k in ("kind", "path")},
        "base_model": {"path": spec.model.path, "folder": str(model_dir),
                       "warm_started": warm, "dtype": spec.model.dtype},
        "dataset": {"source": spec.data.source, **extra.pop("dataset", {})},
        "reward": {"fn": spec.reward.fn, "extract": spec.reward.extract, **extra.pop("reward", {})},
        "prompt": {"template": spec.data.prompt_template, "chat_template": spec.data.chat_template},
        "evaluation": dict(sorted(evaluation.items())),
        "code": code_version(),
        "spec": spec.model_dump(mode="json"),
        **extra,
    }


def model_card(record: dict[str, Any]) -> str:
    """README.md: front matter for the Hugging Face hub, then what the model is and where it
    came from."""
    import yaml

    run, base, data, reward = record["run"], record["base_model"], record["dataset"], record["reward"]
    front = {"library_name": "transformers", "tags": ["oolong", "reinforcement-learning", "grpo"],
             "pipeline_tag": "text-generation"}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {run['name']}, policy version {record['version']}", "",
             f"Trained with asynchronous RL by Oolong ({_code_line(record['code'])}): version "
             f"{record['version']} of run `{run['name']}`"
             + (f", after step {record['step']}" if record["step"] is not None else "") + ".", "",
             "## Lineage", "", "| | |", "|---|---|",
             f"| base model | `{base['path']}`" + (" (warm-started by `oolong sft`)" if base["warm_started"] else "")
             + f", {base['dtype']} |",
             f"| dataset | {_described(data, 'source')} |",
             f"| reward | {_described(reward, 'fn')} |",
             f"| run | {_described(run, 'name')} |",
             f"| weights from | {record['source']['kind']} (`{record['source']['path']}`) |", "",
             "## Evaluation of this version", ""]
    if record["evaluation"]:
        lines += ["| metric | value | 95% interval |", "|---|---|---|", *_evaluation_rows(record["evaluation"])]
    else:
        lines.append("None recorded for this version.")
    prompt = record["prompt"]
    lines += ["", "## Prompting", "",
              f"Prompts were `{prompt['template']}`"
              + (", wrapped in the tokenizer's chat template" if prompt["chat_template"] else "")
              + "; `generation_config.json` holds the run's sampling (greedy: `do_sample=False`).",
              "", "## The resolved run spec", "", "```yaml",
              yaml.safe_dump(record["spec"], sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


def _evaluation_rows(evaluation: dict[str, float]) -> list[str]:
    """One row per metric, its ``_ci_lo``/``_ci_hi`` pair beside it (issue 48's intervals)."""
    rows = []
    for key, value in evaluation.items():
        if key.endswith(("_ci_lo", "_ci_hi")) or key == EVAL_VERSION:
            continue
        lo, hi = evaluation.get(f"{key}_ci_lo"), evaluation.get(f"{key}_ci_hi")
        interval = f"{lo:.3g} – {hi:.3g}" if lo is not None and hi is not None else ""
        rows.append(f"| `{key}` | {value:.4g} | {interval} |")
    return rows


def _code_line(code: dict[str, str]) -> str:
    return f"oolong {code['oolong']}" + (f", commit `{code['commit']}`" if "commit" in code else "")


def _described(part: dict[str, Any], key: str) -> str:
    rest = ", ".join(f"{k} {v}" for k, v in part.items() if k not in (key, "dir"))
    return f"`{part[key]}`" + (f" ({rest})" if rest else "")
