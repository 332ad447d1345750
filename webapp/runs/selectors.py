from __future__ import annotations

import hmac
from typing import Any

from django.db.models import QuerySet
from django.http import Http404

from webapp.runs.models import Run, RunEvent, RunToken, token_hash


def run_list(*, user, project_id: int | None = None, status: str | None = None,
             search: str | None = None) -> QuerySet[Run]:
    qs = Run.objects.filter(project__membership__user=user).select_related(
        "project", "dataset_version__dataset", "reward_version__reward_function")
    if project_id is not None:
        qs = qs.filter(project_id=project_id)
    if status:
        qs = qs.filter(status=status)
    if search:
        qs = qs.filter(name__icontains=search)
    return qs


def run_get(*, user, run_id: int) -> Run:
    try:
        return run_list(user=user).get(id=run_id)
    except Run.DoesNotExist:
        raise Http404("run not found") from None


def runs_get(*, user, run_ids: list[int]) -> list[Run]:
    """The runs in the order given, duplicates once, in one query; 404 if any is not the user's."""
    wanted = list(dict.fromkeys(run_ids))
    found = {r.id: r for r in run_list(user=user).filter(id__in=wanted)}
    if len(found) != len(wanted):
        raise Http404("run not found")
    return [found[i] for i in wanted]


def run_event_list(*, run: Run, after: int = 0, limit: int = 500) -> QuerySet[RunEvent]:
    """The run's events after event id ``after``, oldest first (the live event log polls this)."""
    return run.events.filter(id__gt=after).order_by("id")[:limit]


def run_gateway(*, run: Run) -> dict | None:
    """An online run's gateway: the URL its trainer announced (its latest ``gateway`` event; None
    until the gateway is up) and the run key external agents present. None for other runs."""
    if not run.gateway_key:
        return None
    event = run.events.filter(kind="gateway").order_by("-id").first()
    url = (event.data or {}).get("url") if event is not None else None
    return {"url": url if isinstance(url, str) else None, "run_key": run.gateway_key}


def run_event_recent(*, run: Run, limit: int = 100) -> list[RunEvent]:
    """The newest events first (the run page's event log)."""
    return list(run.events.order_by("-id")[:limit])


def run_token_get(*, token: str) -> RunToken | None:
    """A live ingest token (with its run and purpose); None for an unknown or revoked token, or a
    run that has ended (its tokens stop working with it)."""
    digest = token_hash(token)
    found = (RunToken.objects.select_related("run", "run__reward_version")
             .filter(token_hash=digest, revoked_at__isnull=True).first())
    if found is None or not hmac.compare_digest(found.token_hash, digest):
        return None
    return None if found.run.status in Run.TERMINAL else found


def run_get_by_ingest_token(*, token: str) -> Run | None:
    """The run an ingest token belongs to (see :func:`run_token_get`)."""
    found = run_token_get(token=token)
    return found.run if found is not None else None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


NOT_CONFIG = ("name",)  # a run's label: every run differs there, and it changes nothing


def run_config_diff(*, runs: list[Run]) -> list[dict[str, Any]]:
    """Rows of (key, value per run, differs) over the flattened specs, differing keys first."""
    flats = [{k: v for k, v in _flatten(r.spec).items() if k not in NOT_CONFIG} for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    rows = []
    for key in keys:
        values = [f.get(key) for f in flats]
        rows.append({"key": key, "values": values,
                     "differs": any(v != values[0] for v in values[1:])})
    return sorted(rows, key=lambda r: (not r["differs"], r["key"]))


# ---- the run form: which spec fields a user sets, with what help ----------------------------

# Set by the platform for a run of the web app: its name field, its dataset version, its reward
# version, its tracker and its eval sets (the eval-set dataset versions attached to it).
PLATFORM_FIELDS = ("name", "data.source", "reward.fn", "metrics.", "eval.sets")
# Up front in the form, in this order: what practitioners change most.
COMMON_FIELDS = {
    "model.path": "model",
    "model.warm_start_seconds": "warm start (s)",
    "algorithm.preset": "algorithm preset",
    "trainer.steps": "steps",
    "trainer.batch_groups": "batch (prompt groups, B)",
    "rollout.group_size": "group size",
    "rollout.max_staleness": "max staleness η",
    "rollout.max_new_tokens": "max new tokens",
    "trainer.lr": "learning rate",
}
SECTION_TITLES = {
    "run": "Run", "model": "Model", "data": "Data", "rollout": "Rollout and staleness",
    "reward": "Reward", "algorithm": "Algorithm (empty: the preset's value)",
    "trainer": "Trainer", "checkpoint": "Checkpoints", "eval": "Evaluation",
    "orchestration": "Orchestration", "weight_sync": "Weight sync",
}
SWEEPABLE_KINDS = ("integer", "number", "boolean", "choice")


def run_spec_resolved(*, run: Run):
    """The run's spec with every default filled in by the schema (training_core.config), never
    a default of the web app's own: a field the stored spec lacks reads as the trainer reads it."""
    from training_core.config import spec_from_dict

    return spec_from_dict(run.spec)


def run_spec_overrides(*, run: Run) -> dict[str, Any]:
    """What a user would write to get this run's configuration again: its resolved spec less the
    defaults and the fields the platform sets (a clone's starting point)."""
    from training_core.spec_fields import overrides_of

    def keep(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if path.startswith(PLATFORM_FIELDS) or (path + ".").startswith(PLATFORM_FIELDS):
                continue
            out[key] = keep(value, path + ".") if isinstance(value, dict) and key != "options" \
                else value
        return {k: v for k, v in out.items() if v != {}}

    return keep(overrides_of(run.spec))


def run_spec_fields(*, user) -> list[dict[str, Any]]:
    """The run spec's fields as the form shows them to ``user``: the schema's kind, default,
    bounds and help (training_core.spec_fields), plus ``common``, ``label``, ``admin`` (only
    administrators see those) and ``sweepable``. Members get a choice where only registered
    values are allowed (model.path, rollout.workflow)."""
    from training_core.spec_fields import spec_fields
    from webapp.runs.policy import ADMIN_FIELDS, MEMBER_LIMITS, member_choices

    staff = bool(getattr(user, "is_staff", False))
    restricted = {} if staff else member_choices()
    fields = []
    for field in spec_fields():
        path = field["path"]
        if path.startswith(PLATFORM_FIELDS):
            continue
        admin = path in ADMIN_FIELDS or path.startswith(tuple(p + "." for p in ADMIN_FIELDS))
        if admin and not staff:
            continue
        if path in restricted:
            field.update(kind="choice", choices=restricted[path])
        if not staff and path in MEMBER_LIMITS:  # the form shows the limit a member is held to
            field["maximum"] = min(field.get("maximum", MEMBER_LIMITS[path]), MEMBER_LIMITS[path])
        field.update(
            common=path in COMMON_FIELDS, admin=admin,
            label=COMMON_FIELDS.get(path, field["name"].replace("_", " ")),
            section_title=SECTION_TITLES.get(field["section"], field["section"]),
            sweepable=field["kind"] in SWEEPABLE_KINDS and not admin)
        fields.append(field)
    order = list(COMMON_FIELDS)
    return sorted(fields, key=lambda f: order.index(f["path"]) if f["common"] else len(order))


def run_eval_set_list(*, run: Run) -> list:
    """The eval-set dataset versions attached to the run, in order, each with its ``eval_name``
    (``eval/<name>/...``)."""
    out = []
    for attached in run.eval_sets.select_related("dataset_version__dataset"):
        version = attached.dataset_version
        version.eval_name = attached.name
        out.append(version)
    return out
