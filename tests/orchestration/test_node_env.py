"""What a node's environment file gives its worker reaches the run's processes only as far as
they need it: NCCL's EFA settings do, the node's secrets do not."""

from __future__ import annotations

from training_core.launch import run_env


def test_the_efa_environment_reaches_the_processes_and_the_nodes_secrets_do_not(
        tmp_path, monkeypatch):
    node_env = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
                "LD_LIBRARY_PATH": "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib",
                "NCCL_DEBUG": "INFO",
                # the node's secrets: for its worker and flows, never for a trainer or a server
                "OOLONG_NODE_KEY": "k" * 43 + "=", "PREFECT_API_AUTH_STRING": "oolong:secret",
                "OOLONG_INGEST_TOKEN": "flow-token"}
    for key, value in node_env.items():
        monkeypatch.setenv(key, value)
    env = run_env(tmp_path, 3, (0, 1))
    for key in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "LD_LIBRARY_PATH",
                "NCCL_DEBUG"):
        assert env[key] == node_env[key], key
    assert not {"OOLONG_NODE_KEY", "PREFECT_API_AUTH_STRING", "OOLONG_INGEST_TOKEN"} & set(env)
