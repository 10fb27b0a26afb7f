"""The curl examples of docs/api.md run as written against ``temper serve`` on a fresh data
directory, in the order the page gives them, in one shell (so ``$JOB`` and ``$EPISODE``
carry over). Each ``curl`` must answer 2xx, except where the page shows an error answer
(a ``# {"detail": ...`` comment under it): that one must answer it, word for word."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.services.embedded.test_temper_serve import printed_key, temper_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"

# curl with each answer's status appended to $STATUSES (one line per call), the body printed as curl would
WRAPPER = r"""
set -euo pipefail
curl() {
  local out
  out=$(command curl -w '\n%{http_code}' "$@")
  echo "${out##*$'\n'}" >> "$STATUSES"
  printf '%s\n' "${out%$'\n'*}"
}
"""


def blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def shown_errors(block: str) -> list[str]:
    """The ``detail`` of each error answer the block shows in a comment."""
    return re.findall(r'^# \{"detail": "([^"]+)"', block, re.M)


def test_the_api_pages_curl_examples_run_as_written(tmp_path):
    text = DOC.read_text()
    preamble, *rest = blocks(text)
    assert "export TEMPER_URL" in preamble
    runnable = [b for b in rest if "curl " in b]
    assert len(runnable) >= 7, "the page's examples were found"
    # The page submits three full-weight jobs, and one CPU engine serves one such job at a
    # time: with one engine each, $JOB starts whichever job the scheduler takes first.
    engines = json.dumps([{"name": f"local-{i}", "kind": "local"} for i in range(3)])
    with temper_serve(tmp_path / "data", "docs-api-serve.log", TEMPER_INFERENCE__BACKENDS=engines) as (
        url,
        printed,
        _,
    ):
        key = printed_key(printed)
        statuses = tmp_path / "statuses"
        state = tmp_path / "state.sh"
        state.write_text(f"export TEMPER_URL={url}\nexport TEMPER_API_KEY={key}\n")
        # the preamble's own lines, but the URL and key of this server
        prelude = "\n".join(ln for ln in preamble.splitlines() if not ln.startswith("export TEMPER_"))
        for i, block in enumerate(runnable):
            if "$EPISODE" in block or "/log?" in block:  # the job must have started (the scheduler's pass)
                job = re.search(r"^export JOB=(\S+)$", state.read_text(), re.M)
                assert job, "an earlier example set $JOB"
                wait_for_episode(url, key, job.group(1).strip("'\""))
            statuses.write_text("")
            script = f"{WRAPPER}\nsource {state}\n{prelude}\n{block}\n" + (
                f'for v in JOB NEXT EPISODE; do if [[ -v $v ]]; then echo "export $v=${{!v}}"; fi; done >> {state}\n'
            )
            run = subprocess.run(
                ["bash", "-c", script], cwd=ROOT, env={"STATUSES": str(statuses), "PATH": "/usr/bin:/bin"},
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            where = f"example {i + 1} of docs/api.md:\n{block}\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}"
            assert run.returncode == 0, where
            codes = [int(c) for c in statuses.read_text().split()]
            errors = shown_errors(block)
            assert len(codes) == block.count("curl "), where
            assert sum(c >= 400 for c in codes) == len(errors), f"statuses {codes}; {where}"
            assert all(c < 300 for c in codes if c < 400), f"statuses {codes}; {where}"
            for detail in errors:
                assert f'"detail":"{detail}"' in run.stdout, where
            if "/log?" in block:  # the job's log lines: this job's, and the scheduler's among them
                logged = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"ts"')]
                job = re.search(r"^export JOB=(\S+)$", state.read_text(), re.M)
                assert logged and job and {e["job_id"] for e in logged} == {job.group(1)}, where


def wait_for_episode(url: str, key: str, job: str) -> None:
    deadline = time.monotonic() + 120
    headers = {"Authorization": f"Bearer {key}"}
    while not httpx.get(f"{url}/v1/jobs/{job}/episodes", params={"limit": 1}, headers=headers).json()[
        "items"
    ]:
        assert time.monotonic() < deadline, f"job {job} started no episode"
        time.sleep(0.5)
