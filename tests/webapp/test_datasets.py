import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.webapp.conftest import QA_ROWS, jsonl
from webapp.core.errors import ApplicationError
from webapp.datasets.models import Dataset, DatasetVersion
from webapp.datasets.services import dataset_create_builtin, dataset_upload

pytestmark = pytest.mark.django_db


def test_upload_creates_immutable_versions_with_checksum_stats_preview(project, alice):
    v1 = dataset_upload(project=project, user=alice, name="adds", task="arithmetic",
                        filename="a.jsonl", data=jsonl(QA_ROWS))
    assert v1.version == 1 and v1.row_count == 30 and len(v1.checksum) == 64
    assert v1.preview[0] == {"question": "0+1=", "answer": "1"}
    assert v1.stats["rows"] == 30 and v1.stats["duplicate_questions"] == 0
    same = dataset_upload(project=project, user=alice, name="adds", task="arithmetic",
                          filename="again.jsonl", data=jsonl(QA_ROWS))
    assert same.id == v1.id, "identical content is not a new version"
    v2 = dataset_upload(project=project, user=alice, name="adds", task="arithmetic",
                        filename="b.jsonl", data=jsonl(QA_ROWS[:10]))
    assert v2.version == 2 and v2.checksum != v1.checksum
    v1.refresh_from_db()
    assert v1.row_count == 30  # the old version is untouched


def test_parquet_and_csv_uploads(project, alice):
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(QA_ROWS), buf)
    v = dataset_upload(project=project, user=alice, name="pq", task="qa", filename="d.parquet",
                       data=buf.getvalue())
    assert v.row_count == 30 and v.file_format == "parquet"
    csv = b"question,answer\n1+1=,2\n2+2=,4\n"
    v = dataset_upload(project=project, user=alice, name="csv", task="qa", filename="d.csv", data=csv)
    assert v.row_count == 2


@pytest.mark.parametrize("data,task,expect", [
    (b'{"question": "a", "answer": "1"}\n{broken\n', "qa", [(2, None, "not valid JSON")]),
    (jsonl([{"question": "a"}, {"question": "b", "answer": "2"}]), "qa", [(1, "answer", "missing field")]),
    (jsonl([{"question": "a", "answer": "x"}]), "arithmetic", [(1, "answer", "must be a number")]),
    (jsonl([{"question": "a", "answer": "7"}]), "gsm8k", [(1, "answer", "####")]),
    (jsonl([{"question": "", "answer": "7"}]), "qa", [(1, "question", "empty")]),
    (b"", "qa", [(None, "file", "no rows")]),
])
def test_bad_files_store_nothing_and_name_line_and_field(project, alice, data, task, expect):
    with pytest.raises(ApplicationError) as err:
        dataset_upload(project=project, user=alice, name="bad", task=task, filename="bad.jsonl", data=data)
    got = [(e.get("line"), e["field"], e["message"]) for e in err.value.errors]
    for (line, field, fragment), (gline, gfield, gmsg) in zip(expect, got, strict=False):
        assert gline == line and (field is None or gfield == field) and fragment in gmsg
    assert not Dataset.objects.exists() and not DatasetVersion.objects.exists()


def test_every_bad_row_is_reported_up_to_a_cap(project, alice):
    rows = [{"question": f"q{i}"} for i in range(120)]
    with pytest.raises(ApplicationError) as err:
        dataset_upload(project=project, user=alice, name="bad", task="qa", filename="b.jsonl", data=jsonl(rows))
    assert len(err.value.errors) == 50 and "first 50" in err.value.message


def test_huge_upload_is_refused_before_parsing(project, alice, settings):
    settings.DATASET_MAX_UPLOAD_BYTES = 1000
    with pytest.raises(ApplicationError) as err:
        dataset_upload(project=project, user=alice, name="big", task="qa", filename="b.jsonl",
                       data=b"x" * 5000)
    assert err.value.status_code == 413 and "limit" in err.value.message
    assert not DatasetVersion.objects.exists()


def test_failed_new_version_keeps_the_old_one(project, alice, dataset_version):
    with pytest.raises(ApplicationError):
        dataset_upload(project=project, user=alice, name="adds", task="arithmetic",
                       filename="v2.jsonl", data=b"{nope\n")
    assert list(DatasetVersion.objects.values_list("version", flat=True)) == [1]


def test_builtin_arithmetic(project, alice):
    v = dataset_create_builtin(project=project, user=alice, name="arith", builtin="arithmetic", size=50)
    assert v.row_count == 50 and v.source == "builtin:arithmetic" and v.dataset.task == "arithmetic"


def test_upload_api_and_permissions(api, bob_api, project):
    from django.core.files.uploadedfile import SimpleUploadedFile

    f = SimpleUploadedFile("adds.jsonl", jsonl(QA_ROWS), content_type="application/jsonl")
    r = api.post("/api/datasets/", {"project": project.id, "name": "adds", "task": "arithmetic", "file": f},
                 format="multipart")
    assert r.status_code == 201, r.json()
    version_id = r.json()["id"]
    assert api.get(f"/api/dataset-versions/{version_id}/").json()["row_count"] == 30
    # Bob sees nothing of Alice's project and cannot upload into it.
    assert bob_api.get(f"/api/dataset-versions/{version_id}/").status_code == 404
    assert bob_api.get("/api/datasets/").json() == []
    f2 = SimpleUploadedFile("x.jsonl", jsonl(QA_ROWS), content_type="application/jsonl")
    r = bob_api.post("/api/datasets/", {"project": project.id, "name": "x", "task": "qa", "file": f2},
                     format="multipart")
    assert r.status_code == 404


def test_upload_api_errors_are_json_with_line_and_field(api, project):
    from django.core.files.uploadedfile import SimpleUploadedFile

    f = SimpleUploadedFile("bad.jsonl", b'{"question": "a"}\n', content_type="application/jsonl")
    r = api.post("/api/datasets/", {"project": project.id, "name": "bad", "task": "qa", "file": f},
                 format="multipart")
    assert r.status_code == 400
    body = r.json()
    assert body["errors"][0]["line"] == 1 and body["errors"][0]["field"] == "answer"
    assert "nothing was stored" in body["message"]


def test_revalidate_a_stored_version(dataset_version):
    from webapp.datasets.services import dataset_version_revalidate

    assert dataset_version_revalidate(version_id=dataset_version.id) == {"ok": True, "errors": [], "rows": 30}
    # A schema that tightened after upload: the same rows now fail for a GSM8K task.
    dataset_version.dataset.task = "gsm8k"
    dataset_version.dataset.save()
    report = dataset_version_revalidate(version_id=dataset_version.id)
    assert not report["ok"] and report["errors"][0]["line"] == 1 and report["errors"][0]["field"] == "answer"
