"""The short soak CI runs: scripts/soak.sh with a fixed number of requests (no time window, so a busy
machine only makes it slower); the long, timed one is run by hand."""

from __future__ import annotations

import json
import subprocess

from paged_llm.paths import repo_root


def test_short_soak_has_no_failures_and_returns_every_block(tmp_path):
    report_path = tmp_path / "soak.json"
    completed = subprocess.run(
        ["bash", str(repo_root() / "scripts" / "soak.sh"), "--requests", "64", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["requests_failed"] == 0 and report["requests_succeeded"] >= 64
    assert report["kv_cache_usage_after"] == 0 and report["requests_running_after"] == 0
    assert report["perf_analyzer_exit_code"] == 0
