"""Ingest endpoints for trainers and flows, authenticated by the run's ingest token."""

from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.api.auth import IngestTokenAuthentication, RunIngestUser
from webapp.runs.services import run_event_add, run_status_set
from webapp.tracking.services import checkpoint_record, metrics_ingest, trajectories_ingest


class IngestApi(APIView):
    authentication_classes = [IngestTokenAuthentication]

    @property
    def run(self):
        if not isinstance(self.request.user, RunIngestUser):
            raise PermissionDenied("ingest endpoints take a run ingest token")
        return self.request.auth


class MetricsIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        batch_id = serializers.CharField(required=False)
        points = serializers.ListField(child=serializers.DictField(), allow_empty=True)

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        inserted = metrics_ingest(run=self.run, points=data.validated_data["points"])
        return Response({"inserted": inserted, "received": len(data.validated_data["points"])})


class EventsIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        events = serializers.ListField(child=serializers.DictField())

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        stored = 0
        for e in data.validated_data["events"]:
            ev = run_event_add(run=self.run, kind=str(e.get("kind", "log"))[:30],
                               message=str(e.get("message", "")), data=e.get("data") or {},
                               dedup_key=e.get("dedup_key"))
            stored += ev is not None
        return Response({"stored": stored})


class StatusIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=["provisioning", "running", "succeeded", "failed",
                                                  "cancelled"])
        reason = serializers.CharField(required=False, allow_blank=True, default="")

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        run = run_status_set(run=self.run, **data.validated_data)
        return Response({"status": run.status, "cancel_requested": run.cancel_requested})


class TrajectoriesIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        samples = serializers.ListField(child=serializers.DictField())

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        return Response({"stored": trajectories_ingest(run=self.run, samples=data.validated_data["samples"])})


class CheckpointIngestApi(IngestApi):
    class InputSerializer(serializers.Serializer):
        step = serializers.IntegerField()
        version = serializers.IntegerField()
        path = serializers.CharField()

    def post(self, request):
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        checkpoint_record(run=self.run, **data.validated_data)
        return Response({"ok": True})


class RunInfoIngestApi(IngestApi):
    """What the GPU side needs: the spec, the dataset rows location, cancellation."""

    def get(self, request):
        run = self.run
        return Response({"id": run.id, "name": run.name, "status": run.status,
                         "cancel_requested": run.cancel_requested, "spec": run.spec,
                         "reward": {"fn": run.reward_version.fn_path,
                                    "source": run.reward_version.source}})


class DatasetRowsIngestApi(IngestApi):
    def get(self, request):
        from django.http import FileResponse

        version = self.run.dataset_version
        return FileResponse(open(version.rows_path, "rb"), content_type="application/jsonl",
                            filename=f"dataset-{version.id}.jsonl")
