"""How the web app starts training runs (see platform/orchestration)."""

import os

# Where flows and trainers reach the web app (status, metrics, spec) with a run's token.
OOLONG_PUBLIC_URL = os.environ.get("OOLONG_PUBLIC_URL", "http://127.0.0.1:8000")
