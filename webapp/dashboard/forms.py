"""Forms of the server-rendered pages: they parse and check the raw input, so views never call
``int()`` on a request value and a bad field is reported by name (nothing is stored)."""

from __future__ import annotations

from typing import Any

from django import forms

from training_core.config import parse_scalar
from webapp.core.errors import ApplicationError
from webapp.core.params import IdFormField, parse_count
from webapp.core.spec_yaml import spec_from_yaml
from webapp.runs.models import Run


def parse_spec_yaml(text: str) -> dict[str, Any]:
    """A run spec typed as YAML: a mapping, no aliases. Raises ``forms.ValidationError``."""
    try:
        return spec_from_yaml(text)
    except ApplicationError as exc:
        raise forms.ValidationError(exc.message) from None


class RunListFilterForm(forms.Form):
    status = forms.ChoiceField(choices=[("", "any")] + [(s, s) for s in Run.Status.values],
                               required=False)
    q = forms.CharField(required=False, max_length=200)
    project = IdFormField(required=False)


class RunCompareForm(forms.Form):
    id_list = forms.CharField(required=False, max_length=2000)

    def run_ids(self, picked: list[str]) -> list[int]:
        """Ids from the checkboxes (``ids``, repeated or comma separated) and the free-text list,
        deduplicated in order."""
        raw = [part for value in picked for part in value.split(",")]
        raw += self.cleaned_data.get("id_list", "").split(",")
        ids = []
        for item in (x.strip() for x in raw):
            if not item:
                continue
            number = parse_count(item)
            if number is None:
                raise forms.ValidationError(f"run ids are numbers (digits 0-9, below 2^63), "
                                            f"got {item[:40]!r}")
            ids.append(number)
        return list(dict.fromkeys(ids))


class RunNewForm(forms.Form):
    project = IdFormField()
    name = forms.CharField(required=False, max_length=80)
    dataset_version = IdFormField()
    reward_version = IdFormField()
    spec = forms.CharField(required=False, strip=False)
    # A sweep: one or two fields to vary, each with its comma-separated values.
    sweep_field_1 = forms.CharField(required=False, max_length=100)
    sweep_values_1 = forms.CharField(required=False, max_length=2000)
    sweep_field_2 = forms.CharField(required=False, max_length=100)
    sweep_values_2 = forms.CharField(required=False, max_length=2000)
    share_warm_start = forms.BooleanField(required=False)
    # Dataset versions marked as eval sets, attached to the run (a multiple select).
    eval_set_versions = forms.TypedMultipleChoiceField(required=False, coerce=int, choices=())

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        picked = self.data.getlist("eval_set_versions") if hasattr(self.data, "getlist") else []
        # Any id is a choice: run_create names the field for one that is not an eval set here.
        self.fields["eval_set_versions"].choices = [(v, v) for v in picked]

    def clean_eval_set_versions(self) -> list[int]:
        ids = []
        for value in self.cleaned_data.get("eval_set_versions") or []:
            number = parse_count(str(value))
            if number is None:
                raise forms.ValidationError(f"dataset version ids are numbers, got {value!r}")
            ids.append(number)
        return ids

    def clean_spec(self) -> dict[str, Any]:
        return parse_spec_yaml(self.cleaned_data.get("spec", ""))

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        axes = []
        for i in (1, 2):
            field = (data.get(f"sweep_field_{i}") or "").strip()
            raw = (data.get(f"sweep_values_{i}") or "").strip()
            if not field and not raw:
                continue
            if not field:
                self.add_error(f"sweep_field_{i}", "pick the field these values are for")
            elif not raw:
                self.add_error(f"sweep_values_{i}", f"give the values of {field}, comma separated")
            else:
                axes.append({"field": field,
                             "values": [parse_scalar(v) for v in raw.split(",") if v.strip()]})
        data["axes"] = axes
        return data


class CloneForm(forms.Form):
    clone = IdFormField(required=False)


class DatasetUploadForm(forms.Form):
    project = IdFormField()
    name = forms.CharField(max_length=200)
    task = forms.CharField(required=False, max_length=50)
    file = forms.FileField(error_messages={"required": "choose a file to upload"})
    is_eval_set = forms.BooleanField(required=False)


class DatasetVersionEvalSetForm(forms.Form):
    version = IdFormField()
    is_eval_set = forms.BooleanField(required=False)


class RewardCreateForm(forms.Form):
    project = IdFormField()
    name = forms.CharField(max_length=200)
    builtin = forms.CharField(required=False, max_length=50)
    source = forms.CharField(required=False, strip=False)
    entrypoint = forms.CharField(required=False, max_length=100)
    file = forms.FileField(required=False)


def form_errors(form: forms.Form) -> list[dict[str, Any]]:
    """Form errors in the shape services use: [{"field": ..., "message": ...}]."""
    return [{"field": None if field == "__all__" else field, "message": str(message)}
            for field, messages in form.errors.items() for message in messages]
