"""Sweeps: a group of runs that differ in one or two spec fields, created and queued together
through the same path as any run (``run_create``: validation, the administrator policy, the
Celery submission on commit). Every combination is checked before anything is stored."""

from __future__ import annotations

import itertools
from typing import Any

from django.db import transaction

from webapp.accounts.models import Project
from webapp.core.errors import ApplicationError
from webapp.datasets.models import DatasetVersion
from webapp.rewards.models import RewardFunctionVersion
from webapp.runs.models import Run
from webapp.runs.selectors import (
    PLATFORM_FIELDS,
    run_eval_set_list,
    run_spec_overrides,
    run_spec_resolved,
)
from webapp.runs.services import run_create, run_spec_validate
from webapp.sweeps.models import Sweep

MAX_AXES = 2
MAX_VALUES = 16
MAX_RUNS = 24
SCALARS = (bool, int, float, str)


def _axes_check(axes: Any) -> list[dict[str, Any]]:
    """[{"field": dotted spec key, "values": [scalars]}], one or two, each field once."""
    from training_core.spec_fields import spec_fields

    known = {f["path"] for f in spec_fields()}
    if not isinstance(axes, list) or not 1 <= len(axes) <= MAX_AXES:
        raise ApplicationError(f"give 1 to {MAX_AXES} axes, each a field and its values",
                               field="axes")
    out: list[dict[str, Any]] = []
    for i, axis in enumerate(axes):
        if not isinstance(axis, dict) or set(axis) != {"field", "values"}:
            raise ApplicationError('each axis is {"field": ..., "values": [...]}',
                                   field=f"axes[{i}]")
        field, values = axis["field"], axis["values"]
        if not isinstance(field, str) or field not in known:
            raise ApplicationError(f"{field!r} is not a run spec field (e.g. rollout.max_staleness)",
                                   field=f"axes[{i}].field")
        if field.startswith(PLATFORM_FIELDS):
            raise ApplicationError(f"{field} is set by the platform for every run, not by a sweep",
                                   field=f"axes[{i}].field")
        if field in (a["field"] for a in out):
            raise ApplicationError(f"{field} is already an axis", field=f"axes[{i}].field")
        if not isinstance(values, list) or not 1 <= len(values) <= MAX_VALUES:
            raise ApplicationError(f"give 1 to {MAX_VALUES} values", field=f"axes[{i}].values")
        for j, value in enumerate(values):
            if value is not None and not isinstance(value, SCALARS):
                raise ApplicationError("a value is a number, text, true/false or null",
                                       field=f"axes[{i}].values[{j}]")
        if len({repr(v) for v in values}) != len(values):
            raise ApplicationError("each value once", field=f"axes[{i}].values")
        out.append({"field": field, "values": list(values)})
    count = 1
    for axis in out:
        count *= len(axis["values"])
    if count > MAX_RUNS:
        raise ApplicationError(f"{count} combinations: a sweep holds at most {MAX_RUNS} runs",
                               field="axes")
    return out


def _with(spec: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A copy of ``spec`` with the dotted ``field`` set."""
    out = dict(spec)
    head, _, rest = field.partition(".")
    if rest:
        section = out.get(head)
        out[head] = _with(section if isinstance(section, dict) else {}, rest, value)
    else:
        out[head] = value
    return out


def _run_name(name: str, values: dict[str, Any]) -> str:
    label = " ".join(f"{field.rsplit('.', 1)[-1]}={value}" for field, value in values.items())
    return f"{name} {label}"[:100]


@transaction.atomic
def sweep_create(*, project: Project, user, name: str, dataset_version: DatasetVersion,
                 reward_version: RewardFunctionVersion, spec: dict[str, Any] | None,
                 axes: Any, share_warm_start: bool = True,
                 eval_set_versions: list[DatasetVersion] | None = None) -> Sweep:
    """One run per combination of the axes' values, queued together, each with the same eval
    sets attached. A value the spec refuses is an error naming it (``axes[0].values[2]``) and
    nothing is created."""
    axes = _axes_check(axes)
    base = dict(spec or {})
    combos = []
    errors: list[dict[str, Any]] = []
    for picks in itertools.product(*(list(enumerate(a["values"])) for a in axes)):
        values = {a["field"]: value for a, (_, value) in zip(axes, picks, strict=True)}
        combo = base
        for field, value in values.items():
            combo = _with(combo, field, value)
        try:
            run_spec_validate(spec=combo)
        except ApplicationError as exc:
            for err in exc.errors:
                where = err["field"]
                for i, (a, (j, _)) in enumerate(zip(axes, picks, strict=True)):
                    if where == f"spec.{a['field']}":
                        where = f"axes[{i}].values[{j}]"
                if {"field": where, "message": err["message"]} not in errors:
                    errors.append({"field": where, "message": err["message"]})
        combos.append((values, combo))
    if errors:
        raise ApplicationError("the sweep's runs are not all valid: " + "; ".join(
            f"{e['field']}: {e['message']}" for e in errors), errors=errors)
    sweep = Sweep.objects.create(project=project, name=name, base_spec=base, axes=axes,
                                 share_warm_start=share_warm_start, created_by=user)
    for values, combo in combos:
        run_create(project=project, user=user, name=_run_name(name, values),
                   dataset_version=dataset_version, reward_version=reward_version, spec=combo,
                   sweep=sweep, sweep_values=values, eval_set_versions=eval_set_versions)
    return sweep


def sweep_create_from_run(*, run: Run, user, axes: Any, name: str | None = None) -> Sweep:
    """A sweep of fresh runs around ``run``'s configuration (its dataset, reward, spec and eval
    sets), launched together so that wall time and reward compare fairly, with one warm
    start."""
    return sweep_create(project=run.project, user=user, name=name or run.name,
                        dataset_version=run.dataset_version, reward_version=run.reward_version,
                        spec=run_spec_overrides(run=run), axes=axes,
                        eval_set_versions=run_eval_set_list(run=run))


def sweep_against_synchronous(*, run: Run, user) -> Sweep:
    """"Compare with synchronous": this configuration at its staleness bound and at 0 (or, for
    a synchronous run, at 2), as two fresh runs of one sweep."""
    eta = run_spec_resolved(run=run).rollout.max_staleness
    values = [eta, 0] if eta else [0, 2]
    return sweep_create_from_run(run=run, user=user, name=f"{run.name}: async vs sync"[:100],
                                 axes=[{"field": "rollout.max_staleness", "values": values}])
