"""An agent's only reachable endpoint is its own session of the gateway."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from tests.training_core import conftest as fixtures
from tests.training_core.conftest import run_episode
from tests.training_core.workflows.test_agent_workflow import _workflow

server, tiny_model_dir = fixtures.server, fixtures.tiny_model_dir  # a real embedded server


def test_agent_reaches_only_its_gateway(server, tiny_model_dir):
    # Things on the host the agent must not reach: a TCP listener (by the host's address and by
    # loopback) and a Unix socket in /tmp.
    tcp = socket.socket()
    tcp.bind(("0.0.0.0", 0))
    tcp.listen()
    unix_path = str(Path(tempfile.mkdtemp()) / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    host_ip = socket.gethostbyname(socket.gethostname())
    try:
        wf = _workflow(tiny_model_dir, "probe", group_size=1, retries=0)
        group = run_episode(server, wf, {"question": "x", "host_ip": host_ip,
                                  "host_port": tcp.getsockname()[1],
                                  "unix_paths": [unix_path, "/var/run/docker.sock"]})
        assert group.samples[0].reward == 1.0  # the probe raises if anything answered
        assert group.samples[0].info["agent/turns"] == 1  # and its gateway did
    finally:
        tcp.close()
        unix.close()
