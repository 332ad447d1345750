"""How the web app starts training runs (see platform/orchestration)."""

import os

# "celery" (default): run_submit task -> Prefect deployment; "none": runs stay queued (tests of
# the web app alone).
OOLONG_RUN_SUBMISSION = os.environ.get("OOLONG_RUN_SUBMISSION", "celery")
OOLONG_PUBLIC_URL = os.environ.get("OOLONG_PUBLIC_URL", "http://127.0.0.1:8000")
