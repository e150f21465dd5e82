"""What the chart says about its HPA's two metrics matches what the HPA does: since
Kubernetes 1.21 CPU is no fallback for an unreadable custom metric, as the HPA never scales
down while any of its metrics cannot be read (it may still scale up on the others)."""

from __future__ import annotations

import json
import re

from helm_chart_helpers import CHART, render

CLAIMS_FALLBACK = re.compile(r"(is|as) the fallback|fallback metric|scales on CPU alone", re.I)


def test_hpa_has_both_metrics_by_default() -> None:
    hpa = render({"adapterStore": {"blobs": "s3", "s3": {"bucket": "b"}}, "redis": {"mode": "bundled"},
                  "autoscaling": {"enabled": True}}).get("HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods", "Resource"]


def test_docs_do_not_call_cpu_a_fallback_and_say_the_hpa_never_scales_down_meanwhile() -> None:
    values_comment = (CHART / "values.yaml").read_text().split("  customMetric:", 1)[1].split("  behavior:", 1)[0]
    schema = json.loads((CHART / "values.schema.json").read_text())
    description = schema["properties"]["autoscaling"]["properties"]["cpuTargetUtilization"]["description"]
    readme = (CHART / "README.md").read_text()
    paragraph = readme.split("- Autoscaling:", 1)[1].split("```", 1)[0]
    template = (CHART / "templates" / "hpa.yaml").read_text()
    for where, text in {"values.yaml": values_comment, "schema": description, "README": paragraph,
                        "hpa.yaml": template}.items():
        text = " ".join(text.split())  # wrapped lines
        assert not CLAIMS_FALLBACK.search(text), where
        assert re.search(r"never (scales )?down", text), where
