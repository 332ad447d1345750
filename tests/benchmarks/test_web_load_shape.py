"""benchmarks/web_load.py's report: what the JSON says is computed from the observations it is
given (per-endpoint counts, rates, percentiles, errors, losses, the aims). The load itself is not
run here (minutes of a saturated machine); no timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.modules import benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def web_load():
    return benchmark("web_load")


def _req(name, status, ms):
    return {"name": name, "status": status, "latency_s": ms / 1000}


def test_percentiles_interpolate_between_order_statistics(web_load):
    s = web_load.latency_summary([x / 1000 for x in range(1, 101)])  # 1..100 ms
    assert s["p50_ms"] == pytest.approx(50.5)
    assert s["p95_ms"] == pytest.approx(95.05)
    assert s["p99_ms"] == pytest.approx(99.01)
    assert s["max_ms"] == pytest.approx(100)
    assert web_load.latency_summary([0.2]) == {"p50_ms": 200.0, "p95_ms": 200.0, "p99_ms": 200.0,
                                               "max_ms": 200.0}
    assert web_load.latency_summary([])["p95_ms"] is None


def test_report_counts_errors_losses_and_rates_per_endpoint(web_load):
    requests = ([_req("POST /api/ingest/metrics/", 200, 10 * i) for i in range(1, 11)]
                + [_req("POST /api/ingest/metrics/", 503, 5),
                   {**_req("POST /api/ingest/metrics/", None, 30000), "error": "ReadTimeout"}]
                + [_req("GET /api/runs/compare/", 200, 100), _req("GET /api/runs/compare/", 404, 1)])
    pages = [{"name": "compare page", "status": 200, "latency_s": 0.4},
             {"name": "compare page", "status": 200, "latency_s": 1.6}]
    report = web_load.build_report(
        requests=requests, pages=pages, duration_s=4.0,
        sent={"points": 1000, "samples": 40, "history_points": 200, "history_samples": 0},
        stored={"points": 990, "samples": 40}, config={"quick": True})
    metrics = report["endpoints"]["POST /api/ingest/metrics/"]
    assert metrics["requests"] == 12 and metrics["requests_per_s"] == pytest.approx(3.0)
    assert (metrics["ok"], metrics["errors_5xx"], metrics["transport_errors"]) == (10, 1, 1)
    assert metrics["transport_error_kinds"] == {"ReadTimeout": 1}
    # Latencies of answered requests only: the 503 and the timeout are counted, not averaged in.
    assert metrics["p50_ms"] == pytest.approx(55.0) and metrics["max_ms"] == pytest.approx(100)
    compare = report["endpoints"]["GET /api/runs/compare/"]
    assert compare["errors_4xx"] == 1 and compare["p99_ms"] == pytest.approx(100)
    assert report["errors_5xx"] == 1 and report["errors_4xx"] == 1 and report["transport_errors"] == 1
    assert report["points_lost"] == 10 and report["samples_lost"] == 0 and report["points_extra"] == 0
    assert report["throughput"]["points_per_s"] == pytest.approx((1000 - 200) / 4.0)
    assert report["throughput"]["ingest_requests_per_s"] == pytest.approx(3.0)
    assert report["throughput"]["user_requests_per_s"] == pytest.approx(0.5)
    assert report["compare_view_p95_ms"] == pytest.approx(400 + 0.95 * 1200)
    assert report["aims"]["met"] is False  # a 5xx, lost points, a slow compare page
    json.dumps(report)  # what --out writes


def test_the_aims_are_met_only_with_no_5xx_nothing_lost_and_a_fast_compare_page(web_load):
    def report(status, stored_points, compare_s):
        return web_load.build_report(
            requests=[_req("POST /api/ingest/metrics/", status, 20)],
            pages=[{"name": "compare page", "status": 200, "latency_s": compare_s}],
            duration_s=1.0, sent={"points": 100, "samples": 4},
            stored={"points": stored_points, "samples": 4}, config={})["aims"]["met"]

    assert report(200, 100, 0.5) is True
    assert report(500, 100, 0.5) is False
    assert report(200, 99, 0.5) is False
    assert report(200, 100, 1.5) is False


def test_the_reference_results_have_the_fields_the_issue_names():
    for name in ("web_load.json", "web_load_quick.json"):
        path = ROOT / "benchmarks" / "results" / name
        if not path.exists():
            pytest.skip(f"{name} not recorded yet")
        report = json.loads(path.read_text())
        assert {"errors_5xx", "points_lost", "endpoints"} <= set(report)
        for stats in report["endpoints"].values():
            assert {"p50_ms", "p95_ms", "p99_ms", "requests_per_s"} <= set(stats)
        assert report["config"]["runs"] == 32 and report["config"]["users"] == 16
