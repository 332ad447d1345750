"""Issue 47, item 6: an agent's /scratch was a host directory: 300 MB and 20,000 files in
seconds, left behind by a killed trainer. It is now the jail's own sized tmpfs (gone with the
jail), and the gateway's socket is the only thing of the host bound in."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.training_core import conftest as fixtures
from tests.training_core.conftest import run_episode
from training_core.api import EpisodeError, SamplingParams
from training_core.config import AgentSpec

server, tiny_model_dir = fixtures.server, fixtures.tiny_model_dir  # a real embedded server


def test_300_mb_and_20000_files_in_scratch_are_refused_and_nothing_stays_on_the_host(
        server, tiny_model_dir):
    from training_core.models.loading import load_tokenizer
    from training_core.workflows import load_workflow
    from training_core.workflows.base import WorkflowContext

    ctx = WorkflowContext(tokenizer=load_tokenizer(tiny_model_dir), rewards=None,  # type: ignore[arg-type]
                          sampling=SamplingParams(max_new_tokens=4), group_size=1,
                          agent=AgentSpec(timeout_s=90, retries=0))
    wf = load_workflow("agent:tests/security/attack_agents.py:fill_scratch", ctx)
    before = set(Path(tempfile.gettempdir()).glob("oolong-agent-*"))
    with pytest.raises(EpisodeError) as caught:
        run_episode(server, wf, {"question": "1+1="})
    found = json.loads(str(caught.value).split("FOUND", 1)[1].split("}", 1)[0] + "}")
    assert found["cwd"] == "/scratch" and found["scratch_mb"] == 64, found
    # The 300 MB file stops at the file-size rlimit (10 MB), the files when 64 MB of pages are used.
    assert found["written_mb"] <= 64 and found["files"] <= 64 * 256 < 20_000, found
    assert any("No space left on device" in e for e in found["errors"]), found
    # Nothing of the episode stays on the host: its socket directory went with the jail.
    assert set(Path(tempfile.gettempdir()).glob("oolong-agent-*")) == before
