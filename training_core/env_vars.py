"""Every ``OOLONG_*`` environment variable, once: who reads it and what it does.

The code reads each where it is used; this table is where a reader finds them all, and
``docs/environment.md`` is generated from it (``python -m training_core.env_vars > docs/
environment.md``). tests/test_env_vars.py fails on a variable the tree reads that is not
here, on one here that nothing reads, and on a stale docs page. A name ending in ``*`` is a
family (``OOLONG_QUOTA_<NAME>``).
"""

from __future__ import annotations

# name -> (who reads it, what it does)
VARIABLES: dict[str, tuple[str, str]] = {
    # ---- engine processes (trainer, rollout servers) -------------------------------------------
    "OOLONG_CACHE": ("engine", "cache root: converted models, built CPU kernels, the jail's runtime images (default ~/.cache/oolong)"),
    "OOLONG_RUN_ID": ("engine", "marks every process of a run (teardown finds them by it)"),
    "OOLONG_PROCESS_TAG": ("engine", "marks the processes a ManagedProcess started (stop_all)"),
    "OOLONG_PORT_RANGE": ("nodes", "the ports a node's processes listen on, LOW-HIGH (the security group's range)"),
    "OOLONG_NODE_ADDRESS": ("nodes", "the address other nodes reach this node at"),
    "OOLONG_SERVER_KEY": ("engine", "the run's rollout-server secret: servers require it, the trainer sends it"),
    "OOLONG_SGLANG_PYTHON": ("launcher", "the interpreter of SGLang's own environment"),
    "OOLONG_CHECKPOINT_STORE": ("trainer", "durable checkpoint store (fsspec URL or folder)"),
    "OOLONG_GATEWAY_KEY": ("trainer", "the online gateway's run key, when the platform hands one in"),
    "OOLONG_FUSED_DECODE": ("rollout server", "0: decode through transformers' forward (kill switch)"),
    "OOLONG_CPU_KERNELS": ("rollout server", "0: the pure-torch reference path: no C++ kernels, "
                           "no prepacked weights, no fused decode step (the one switch)"),
    "OOLONG_AMX": ("rollout server", "0: not the AMX projection kernel (tests force paths with it)"),
    "OOLONG_AVX512_LINEAR": ("rollout server", "0/1: never / always the AVX-512 projection kernel"),
    "OOLONG_AVX2_LINEAR": ("rollout server", "0/1: never / always the AVX2 projection kernel"),
    "OOLONG_PREFIX_CACHE_MB": ("rollout server", "the prefix cache's budget across requests; 0 turns it off"),
    "OOLONG_JAIL_UIDS": ("jail", "the uid range jails lease from, first-last"),
    "OOLONG_JAIL_PACKAGES": ("jail", "the installed distributions jailed code may import, with their dependencies, comma-separated: default (the list in training_core/jail/runtime.py), more names (default,pandas), or none (the standard library alone)"),
    "OOLONG_REWARD_BROKER_URL": ("trainer", "the remote reward backend's Celery broker"),
    "OOLONG_REWARD_RESULT_BACKEND": ("trainer", "the remote reward backend's result store"),
    # ---- orchestration (flows, nodes, providers) -------------------------------------------------
    "OOLONG_RUNS_DIR": ("flows", "where flows keep run directories (default ./runs)"),
    "OOLONG_HOME": ("Prefect deployments", "the checkout a control-plane worker runs flows from"),
    "OOLONG_PREFECT_MODE": ("web app, flows", "how runs start: local process, or Prefect server deployments"),
    "OOLONG_PUBLIC_URL": ("web app, flows", "the web app's URL as nodes and trainers reach it"),
    "OOLONG_INGEST_TOKEN": ("flows", "a local flow's run token, in its environment (never argv)"),
    "OOLONG_RAY_ADDRESS": ("flows", "the Ray cluster static nodes joined"),
    "OOLONG_STATIC_NODES": ("flows", "the static provider's nodes: address[:gpus],..."),
    "OOLONG_NODE_POOL": ("nodes", "the work pool static nodes' workers serve"),
    "OOLONG_NODE_QUEUE": ("nodes", "this node's work queue (node-<i>), set by cloud-init"),
    "OOLONG_NODE_INDEX": ("nodes", "this node's index, set by cloud-init"),
    "OOLONG_NODE_KEY": ("nodes", "the key sealed run credentials open with on this node (per run on "
                        "Terraform nodes; one per deployment on static nodes)"),
    "OOLONG_CONTROL_KEY": ("web app, flows", "the key the training-run flow's sealed token opens with "
                           "(server mode)"),
    "OOLONG_BUILD_DIR": ("flows", "a release's wheel and constraints to install on nodes, instead of a "
                         "build of this checkout"),
    "OOLONG_TERRAFORM_STORE_URL": ("flows", "the Terraform runs' store (s3://bucket/prefix; a folder "
                                   "in tests)"),
    "OOLONG_TERRAFORM_BIN": ("flows", "the terraform binary"),
    "OOLONG_TERRAFORM_WORKSPACES": ("flows", "where each run's Terraform workspace lives"),
    "OOLONG_TERRAFORM_TIMEOUT_S": ("flows", "how long one terraform apply or destroy may take"),
    "OOLONG_TERRAFORM_SKIP_CREDENTIAL_CHECK": ("flows", "1: do not check cloud credentials first (tests)"),
    # ---- web app ---------------------------------------------------------------------------------
    "OOLONG_DATA_DIR": ("web app", "the embedded defaults' data folder (SQLite, media)"),
    "OOLONG_MEDIA_ROOT": ("web app", "uploaded files"),
    "OOLONG_PORT": ("demo", "the demo web app's port"),
    "OOLONG_API_TOKENS_PER_USER": ("web app", "API tokens a user may hold"),
    "OOLONG_API_TOKEN_TTL_DAYS": ("web app", "API token lifetime"),
    "OOLONG_LOGIN_FAILURE_LIMIT": ("web app", "failed logins before the throttle"),
    "OOLONG_TRUSTED_PROXIES": ("web app", "proxies whose X-Forwarded-For is believed"),
    "OOLONG_SERIES_CACHE_S": ("web app", "how long a chart series read is cached"),
    "OOLONG_QUOTA_*": ("web app", "per-project quotas, OOLONG_QUOTA_<NAME> (webapp/accounts)"),
    "OOLONG_DATASET_MAX_UPLOAD_MB": ("web app", "largest dataset upload"),
    "OOLONG_DATASET_MAX_DECOMPRESSED_MB": ("web app", "largest decompressed dataset"),
    "OOLONG_DATASET_MAX_ROWS": ("web app", "most rows in a dataset"),
    "OOLONG_DATASET_MAX_CELL_CHARS": ("web app", "longest cell in a dataset"),
    "OOLONG_DATASET_PARSE_MEMORY_MB": ("web app", "memory a dataset parse may use"),
    "OOLONG_REWARD_MAX_MEMORY_MB": ("web app", "most memory a reward function may ask for"),
    "OOLONG_INGEST_MAX_*": ("web app", "per-run ingest bounds: _TRAJECTORIES, _TRAJECTORY_MB, _METRIC_KEYS, _EVENTS"),
    "OOLONG_INGEST_RATE_PER_S": ("web app", "requests a run token may make per second"),
    "OOLONG_WEB_*": ("serve.sh", "the web pool: _BIND, _WORKERS, _THREADS, _TIMEOUT_S, _POOL"),
    "OOLONG_INGEST_*": ("serve.sh", "the ingest pool: _BIND, _WORKERS, _THREADS, _NICE"),
    "OOLONG_BIN": ("serve.sh", "the virtualenv's bin folder"),
    # ---- CLI ---------------------------------------------------------------------------------------
    "OOLONG_URL": ("CLI", "the web app oolong runs/sweeps talk to"),
    "OOLONG_TOKEN": ("CLI", "the user's API token"),
    # ---- tests and CI ------------------------------------------------------------------------------
    "OOLONG_TEST_LANES": ("make test", "1: one lane instead of two"),
    "OOLONG_TEST_DURATIONS": ("make test", "how many slowest tests each lane lists"),
    "OOLONG_TEST_REDIS": ("make test", "the Redis a lane's tests use"),
    "OOLONG_SERVICES_STATE": ("make test", "what services.sh started (to stop it)"),
    "OOLONG_VM_DIR": ("make test", "the cgroup v2 VM's kernel and busybox"),
    "OOLONG_CHECKOV": ("make test", "the checkov binary (its own environment)"),
    "OOLONG_SGLANG_SOURCE": ("make test", "the unpacked SGLang wheel the contract tests read"),
    "OOLONG_REQUIRE_SGLANG_SOURCE": ("make test", "1: the contract tests fail without that source"),
    "OOLONG_FAKE_TF_LOG": ("tests", "where the fake terraform records its calls"),
    "OOLONG_FAKE_TF_BOOT": ("tests", "the fake terraform boots loopback nodes from cloud-init"),
    "OOLONG_FAKE_TF_PYTHON": ("tests", "the interpreter the fake terraform's nodes use"),
    "OOLONG_SGLANG_WHEEL": ("tests", "the pinned SGLang wheel the node-install tests read"),
}


def covers(name: str) -> bool:
    """Whether ``name`` is registered, itself or as a member of a ``*`` family."""
    return name in VARIABLES or any(
        key.endswith("*") and name.startswith(key[:-1]) for key in VARIABLES)


def markdown() -> str:
    lines = ["# Environment variables",
             "",
             "Every `OOLONG_*` variable the platform reads. Generated from",
             "`training_core/env_vars.py` (`python -m training_core.env_vars > docs/environment.md`);",
             "a test keeps both in step with the code.",
             "",
             "| variable | read by | what it does |",
             "|---|---|---|"]
    lines += [f"| `{name}` | {who} | {what} |" for name, (who, what) in VARIABLES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
