"""Who may set what in a run spec. Infrastructure fields decide where code runs, what it reaches
and what it costs: they are for site administrators (``is_staff``), not for project members (a
member owns the projects they create, so project ownership cannot be the gate). Members create
runs from what administrators registered: the built-in models, the registered workflows, this
deployment's reward backend, servers and nodes.
"""

from __future__ import annotations

from typing import Any

from training_core.models.paths import REGISTERED_MODELS, TINY
from webapp.core.errors import ApplicationError

# Fields only an administrator may change from their default.
ADMIN_FIELDS = ("orchestration.provider", "orchestration.terraform_vars", "rollout.server_urls",
                "reward.remote_backend", "run_dir",
                # where the online gateway listens and how it is reached: the network's business
                "rollout.agent.gateway_host", "rollout.agent.gateway_port",
                "rollout.agent.public_url")


# Every member-settable number that costs memory, CPU, disk or time has a bound (issue 47: quotas
# covered 6 fields; reward.memory_mb went to 256 GB, restart counts held machines forever).
# A field is bounded by a project quota (webapp.accounts.selectors.QUOTA_FIELDS), by a hard member
# limit here (administrators are not bound), or is listed in COSTLESS_FIELDS with why any value
# costs nothing. tests/security/test_member_limits.py walks the spec schema and fails on a numeric
# member field in none of them: a new field must be classified here (docs/security.md).
MEMBER_LIMITS: dict[str, float] = {
    # model
    "model.num_heads": 64,
    "model.warm_start_seconds": 3600,
    "model.warm_start_steps": 100_000,
    "model.lora.rank": 256,  # the adapter's size and its optimizer state grow with it
    # data: rows drawn and held in memory
    "data.size": 1_000_000,
    "data.eval_size": 10_000,
    # rollout: samples in flight, their length, how long they may take
    "rollout.max_staleness": 64,
    "rollout.group_size": 64,
    "rollout.request_timeout_s": 3600,
    "rollout.max_interruptions": 64,
    "rollout.batch_timeout_s": 7200,
    "rollout.max_turns": 32,
    "rollout.server_threads": 16,
    "rollout.tp": 8,
    "rollout.max_batch_size": 1024,
    "rollout.agent.max_turns": 64,
    "rollout.agent.max_tokens": 32_768,
    "rollout.agent.timeout_s": 1800,
    "rollout.agent.retries": 3,
    "rollout.agent.memory_mb": 8192,
    # reward: a jail's memory and deadline, how long a failing run goes on
    "reward.timeout_s": 300,
    "reward.memory_mb": 8192,
    "reward.max_failing_steps": 20,
    # trainer
    "trainer.batch_groups": 256,
    "trainer.ppo_minibatches": 64,
    "trainer.micro_batch_tokens": 65_536,
    "trainer.threads": 16,
    # disk and eval time
    "checkpoint.keep": 10,
    "eval.size": 10_000,
    "eval.samples": 64,  # completions per eval question, each eval
    # how long a stuck or lost run holds its machines, and how often it starts again
    "orchestration.placement.trainer_nodes": 8,
    "orchestration.placement.trainer_gpus_per_node": 8,
    "orchestration.heartbeat_timeout_s": 3600,
    "orchestration.max_server_restarts": 5,
    "orchestration.server_lost_after_s": 900,
    "orchestration.probe_timeout_s": 60,
    "orchestration.worker_lost_after_s": 900,
    "orchestration.nodes_online_timeout_s": 3600,
    "orchestration.max_restarts": 3,
}
# Numbers whose value costs nothing (or less the larger it is), each with why.
COSTLESS_FIELDS: dict[str, str] = {
    "seed": "a seed",
    "rollout.max_token_staleness": "a filter: only drops samples",
    "rollout.temperature": "a sampling parameter", "rollout.top_p": "a sampling parameter",
    "rollout.top_k": "a sampling parameter (the vocabulary bounds it)",
    "rollout.turn_discount": "a coefficient", "rollout.agent.discount": "a coefficient",
    "rollout.agent.gateway_port": "a port number (0-65535)",
    "rollout.mem_fraction": "a share of the server's own GPU (0-1); a plan that cannot fit is "
                            "refused before anything starts (training_core/gpu_memory.py)",
    "reward.max_abs": "a bound itself (at most 1e12)",
    "trainer.lr": "a coefficient", "trainer.weight_decay": "a coefficient",
    "trainer.grad_clip": "a coefficient",
    "trainer.activation_checkpointing": "a switch trading the run's own GPU memory for about a "
                                        "third more compute per update, which the step and "
                                        "batch limits already bound",
    "checkpoint.every": "steps between checkpoints: larger costs less",
    "eval.every": "steps between evals: larger costs less",
    "eval.k": "a statistic of the eval.samples already drawn (at most eval.samples)",
    "data.allow_eval_overlap": "a switch: eval questions stay in the training pool (in-sample "
                               "evaluation, recorded as such); removes nothing, costs nothing",
    "orchestration.placement.server_nodes": "node indices: the run's nodes bound them",
    "algorithm.*": "loss coefficients",
    "model.lora.alpha": "a coefficient (the adapter's scale)",
    "model.lora.dropout": "a probability (0-1)",
}
NUMERIC_KINDS = ("integer", "number")


def member_numeric_fields() -> list[dict[str, Any]]:
    """The spec's numeric fields (lists of numbers too) a member may set: what must be bounded."""
    from training_core.spec_fields import optional_section_fields, spec_fields

    return [f for f in [*spec_fields(), *optional_section_fields()]
            if (f["kind"] in NUMERIC_KINDS or f.get("item_kind") in NUMERIC_KINDS)
            and not _admin_only(f["path"])]


def _admin_only(path: str) -> bool:
    return any(path == a or path.startswith(a + ".") for a in ADMIN_FIELDS)


def costless(path: str) -> bool:
    return path in COSTLESS_FIELDS or any(
        k.endswith(".*") and path.startswith(k[:-1]) for k in COSTLESS_FIELDS)


def unbounded_member_fields() -> list[str]:
    """Numeric member fields with no quota, no member limit and no reason to need neither."""
    from webapp.accounts.selectors import QUOTA_FIELDS

    quota = set(QUOTA_FIELDS.values()) | {"model.hidden_size", "model.num_layers"}  # "model"
    return [f["path"] for f in member_numeric_fields()
            if f["path"] not in quota and f["path"] not in MEMBER_LIMITS and not costless(f["path"])]


def member_limit_errors(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each field of a resolved spec over its hard member limit."""
    errors = []
    for path, maximum in MEMBER_LIMITS.items():
        value = _get(spec, path)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > maximum:
            errors.append({"field": f"spec.{path}", "maximum": maximum,
                           "message": f"{value:,} is over the maximum of {maximum:,} a member may "
                                      "set; an administrator can run it"})
    return errors


def member_choices() -> dict[str, list[str]]:
    """Fields a member may set, but only to what administrators registered."""
    from training_core.workflows import WORKFLOWS

    return {"model.path": list(REGISTERED_MODELS), "rollout.workflow": list(WORKFLOWS)}


def _default(path: str) -> Any:
    from training_core.config import RunSpec

    node: Any = RunSpec()
    for part in path.split("."):
        node = getattr(node, part, None)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


def _get(spec: dict[str, Any], path: str) -> Any:
    node: Any = spec
    for part in path.split("."):
        if node is None:  # an optional section left empty (model.lora): nothing set below it
            return None
        if not isinstance(node, dict) or part not in node:
            return _default(path)
        node = node[part]
    return node


def infrastructure_fields(spec: dict[str, Any]) -> list[str]:
    """The dotted fields of a resolved spec that only an administrator may set."""
    found = [path for path in ADMIN_FIELDS if _get(spec, path) != _default(path)]
    found += [path for path, allowed in member_choices().items() if _get(spec, path) not in allowed]
    return found


def check_spec_allowed(*, user, spec: dict[str, Any]) -> None:
    """403 naming each administrator-only field a member set, and each field over its member
    limit (administrators are bound by neither)."""
    if getattr(user, "is_staff", False):
        return
    fields = infrastructure_fields(spec)
    if fields:
        raise ApplicationError(
            f"only administrators can set {', '.join(fields)}: infrastructure fields decide "
            "where code runs and what it reaches; use the defaults or ask an administrator",
            errors=[{"field": f"spec.{f}", "message": "administrators only"} for f in fields],
            status_code=403)
    errors = member_limit_errors(spec)
    if errors:
        raise ApplicationError("over a member's limits: " + "; ".join(
            f"{e['field']} (maximum {e['maximum']:,})" for e in errors), errors=errors,
            status_code=403)


def tiny_model_params(hidden_size: int, num_layers: int) -> int:
    """Parameters of the tiny model (training_core.models.tiny): per layer four h x h attention
    projections and three h x 2h MLP matrices, plus the (small) embeddings, rounded up."""
    return num_layers * 10 * hidden_size * hidden_size + 512 * hidden_size


def quota_errors(*, limits: dict[str, int], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each field of a resolved spec over the project's maxima (webapp.accounts.selectors)."""
    from webapp.accounts.selectors import QUOTA_FIELDS

    errors = []
    for name, path in QUOTA_FIELDS.items():
        maximum = limits[name]
        if path == "model":
            if _get(spec, "model.path") != TINY:
                continue  # a registered pretrained model has its own, fixed size
            hidden, layers = _get(spec, "model.hidden_size"), _get(spec, "model.num_layers")
            params = tiny_model_params(hidden, layers)
            if params > maximum:
                errors.append({"field": "spec.model.hidden_size", "maximum": maximum,
                               "message": f"a tiny model of hidden_size {hidden} and num_layers "
                                          f"{layers} has about {params:,} parameters; this "
                                          f"project's maximum is {maximum:,} ({name})"})
        elif (value := _get(spec, path)) > maximum:
            errors.append({"field": f"spec.{path}", "maximum": maximum,
                           "message": f"{value:,} is over this project's maximum of {maximum:,} "
                                      f"({name}); ask an administrator to raise it"})
    return errors


def check_quota(*, project, user, spec: dict[str, Any]) -> None:
    """403 naming each field over the project's maxima; administrators are not bound."""
    if getattr(user, "is_staff", False):
        return
    from webapp.accounts.selectors import project_quota_limits

    errors = quota_errors(limits=project_quota_limits(project=project), spec=spec)
    if errors:
        raise ApplicationError("over the project's quota: " + "; ".join(
            f"{e['field']} (maximum {e['maximum']:,})" for e in errors), errors=errors,
            status_code=403)
