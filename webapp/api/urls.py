from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from webapp.accounts import apis as accounts
from webapp.api.errors import api_not_found
from webapp.api.views import combine
from webapp.datasets import apis as datasets
from webapp.registry import apis as registry
from webapp.rewards import apis as rewards
from webapp.runs import apis as runs
from webapp.sweeps import apis as sweeps
from webapp.tracking import apis as tracking

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="docs"),
    path("auth/token/", accounts.TokenObtainApi.as_view(), name="api-token"),
    path("auth/tokens/", accounts.TokenListApi.as_view(), name="api-tokens"),
    re_path(r"^auth/tokens/(?P<token_key>[0-9A-Za-z_-]{1,25})/$", accounts.TokenRevokeApi.as_view()),
    path("projects/", combine("ProjectsApi", accounts.ProjectCreateApi, accounts.ProjectListApi).as_view()),
    path("projects/<id:project_id>/quota/", accounts.ProjectQuotaApi.as_view()),
    path("datasets/", combine("DatasetsApi", datasets.DatasetUploadApi, datasets.DatasetListApi).as_view()),
    path("datasets/builtin/", datasets.DatasetBuiltinCreateApi.as_view()),
    path("datasets/<id:dataset_id>/", datasets.DatasetDetailApi.as_view()),
    path("dataset-versions/<id:version_id>/", datasets.DatasetVersionDetailApi.as_view()),
    path("rewards/", combine("RewardsApi", rewards.RewardCreateApi, rewards.RewardListApi).as_view()),
    path("rewards/<id:reward_id>/", rewards.RewardDetailApi.as_view()),
    path("runs/", combine("RunsApi", runs.RunCreateApi, runs.RunListApi).as_view()),
    path("runs/compare/", tracking.RunCompareApi.as_view()),
    path("runs/compare/evals/", tracking.RunEvalCompareApi.as_view()),
    path("runs/spec-schema/", runs.RunSpecSchemaApi.as_view()),
    path("runs/spec-check/", runs.RunSpecCheckApi.as_view()),
    path("runs/<id:run_id>/", tracking.RunDetailApi.as_view()),
    path("runs/<id:run_id>/cancel/", runs.RunCancelApi.as_view()),
    path("runs/<id:run_id>/resume/", runs.RunResumeApi.as_view()),
    path("runs/<id:run_id>/events/", runs.RunEventsApi.as_view()),
    path("runs/<id:run_id>/sweep/", sweeps.SweepFromRunCreateApi.as_view()),
    path("sweeps/", combine("SweepsApi", sweeps.SweepCreateApi, sweeps.SweepListApi).as_view()),
    path("sweeps/<id:sweep_id>/", sweeps.SweepDetailApi.as_view()),
    path("sweeps/<id:sweep_id>/compare/", sweeps.SweepCompareApi.as_view()),
    path("runs/<id:run_id>/export/", registry.RunExportApi.as_view()),
    path("models/", registry.ModelListApi.as_view()),
    path("models/<id:model_id>/", registry.ModelDetailApi.as_view()),
    path("models/<id:model_id>/download/", registry.ModelDownloadApi.as_view()),
    path("models/<id:model_id>/aliases/", registry.ModelAliasesApi.as_view()),
    re_path(r"^models/(?P<model_id>[0-9]{1,18})/aliases/(?P<alias>[a-z][a-z0-9_.-]{0,49})/$",
            registry.ModelAliasDeleteApi.as_view()),
    path("runs/<id:run_id>/metrics/", tracking.RunMetricsApi.as_view()),
    path("runs/<id:run_id>/trajectories/", tracking.RunTrajectoriesApi.as_view()),
    path("runs/<id:run_id>/evals/", tracking.RunEvalsApi.as_view()),
    path("ingest/run/", tracking.RunInfoIngestApi.as_view()),
    path("ingest/node-credential/", tracking.NodeCredentialIngestApi.as_view()),
    path("ingest/dataset/", tracking.DatasetRowsIngestApi.as_view()),
    path("ingest/eval-sets/<id:version_id>/", tracking.EvalSetRowsIngestApi.as_view()),
    path("ingest/metrics/", tracking.MetricsIngestApi.as_view()),
    path("ingest/events/", tracking.EventsIngestApi.as_view()),
    path("ingest/status/", tracking.StatusIngestApi.as_view()),
    path("ingest/trajectories/", tracking.TrajectoriesIngestApi.as_view()),
    path("ingest/checkpoints/", tracking.CheckpointIngestApi.as_view()),
    # Last: anything else under /api/ is a JSON 404, DEBUG or not.
    re_path(r"^(?P<rest>[\s\S]*)\Z", api_not_found),  # newlines too (%0A in a path)
]
