"""Who may set what in a run spec. Infrastructure fields decide where code runs, what it reaches
and what it costs: they are for site administrators (``is_staff``), not for project members (a
member owns the projects they create, so project ownership cannot be the gate). Members create
runs from what administrators registered: the built-in models, the registered workflows, this
deployment's reward backend, servers and nodes.
"""

from __future__ import annotations

from typing import Any

from webapp.core.errors import ApplicationError

REGISTERED_MODELS = ("tiny", "smollm2")  # training_core.models.paths builds these locally
# Fields only an administrator may change from their default.
ADMIN_FIELDS = ("orchestration.provider", "orchestration.terraform_vars", "rollout.server_urls",
                "reward.remote_backend", "run_dir",
                # where the online gateway listens and how it is reached: the network's business
                "rollout.agent.gateway_host", "rollout.agent.gateway_port",
                "rollout.agent.public_url")


def member_choices() -> dict[str, list[str]]:
    """Fields a member may set, but only to what administrators registered."""
    from training_core.workflows import WORKFLOWS

    return {"model.path": list(REGISTERED_MODELS), "rollout.workflow": list(WORKFLOWS)}


def _default(path: str) -> Any:
    from training_core.config import RunSpec

    node: Any = RunSpec()
    for part in path.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


def _get(spec: dict[str, Any], path: str) -> Any:
    node: Any = spec
    for part in path.split("."):
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
    if getattr(user, "is_staff", False):
        return
    fields = infrastructure_fields(spec)
    if fields:
        raise ApplicationError(
            f"only administrators can set {', '.join(fields)}: infrastructure fields decide "
            "where code runs and what it reaches; use the defaults or ask an administrator",
            errors=[{"field": f"spec.{f}", "message": "administrators only"} for f in fields],
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
            if _get(spec, "model.path") != "tiny":
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
