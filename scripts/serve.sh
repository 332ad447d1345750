#!/usr/bin/env bash
# The production web server as an operator runs it: migrations, then gunicorn serving the WSGI
# app with the production settings. Everything comes from the environment (docs/operations.md):
#   DJANGO_SECRET_KEY, DATABASE_URL (PostgreSQL), CELERY_BROKER_URL and DJANGO_CACHE_URL (Redis),
#   DJANGO_ALLOWED_HOSTS; OOLONG_WEB_BIND (default 127.0.0.1:8000), OOLONG_WEB_WORKERS (default
#   2 x cores + 1), OOLONG_WEB_THREADS (default 4), OOLONG_WEB_TIMEOUT_S (default 60).
# OOLONG_WEB_POOL=ingest runs the pool for trainers' ingest (the proxy sends /api/ingest/ to it)
# instead: OOLONG_INGEST_BIND (default 127.0.0.1:8001), OOLONG_INGEST_WORKERS (default: cores),
# OOLONG_INGEST_THREADS (default 4), at CPU priority OOLONG_INGEST_NICE (default 10); it runs no
# migrations (start the web pool first).
# Extra arguments go to gunicorn (e.g. --access-logfile -).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${OOLONG_BIN:-.venv/bin}
export DJANGO_SETTINGS_MODULE=${DJANGO_SETTINGS_MODULE:-webapp.config.settings.production}
POOL=${OOLONG_WEB_POOL:-web}

# The cache must be shared by every worker process: the login throttle counts in it.
if [ -z "${DJANGO_CACHE_URL:-}" ] && [ "$DJANGO_SETTINGS_MODULE" = webapp.config.settings.production ]; then
  echo "serve: set DJANGO_CACHE_URL (e.g. redis://127.0.0.1:6379/2): the worker processes share it" >&2
  exit 2
fi

case "$POOL" in
  web)
    "$BIN/python" manage.py migrate --noinput >/dev/null
    BIND=${OOLONG_WEB_BIND:-127.0.0.1:8000}
    WORKERS=${OOLONG_WEB_WORKERS:-$((2 * $(nproc) + 1))}
    THREADS=${OOLONG_WEB_THREADS:-4}
    NICE=0 ;;
  ingest)
    # Trainers post at full speed and their sinks spool and retry: on a host it shares with the
    # web pool, this pool yields the CPU to people's pages (nice) and, being a pool of its own,
    # never holds a web thread, so a page never queues behind a burst of batches. Each batch is
    # still stored before it is acknowledged.
    BIND=${OOLONG_INGEST_BIND:-127.0.0.1:8001}
    WORKERS=${OOLONG_INGEST_WORKERS:-$(nproc)}
    THREADS=${OOLONG_INGEST_THREADS:-4}
    NICE=${OOLONG_INGEST_NICE:-10} ;;
  *)
    echo "serve: OOLONG_WEB_POOL must be web or ingest, not $POOL" >&2
    exit 2 ;;
esac

# The kernel shares the CPU between sessions (autogroups) and cgroups before it weighs the nice
# values inside each: a pool started in a session of its own (systemd, setsid) gives that session
# the same priority, or its nice would only rank it against itself. (Under systemd with cgroup
# CPU control, set CPUWeight= on the unit as well: docs/operations.md.)
if [ "$NICE" != 0 ] && [ "$(ps -o sid= -p $$ | tr -d ' ')" = "$$" ] && [ -w /proc/self/autogroup ]; then
  echo "$NICE" > /proc/self/autogroup 2>/dev/null || true
fi

# gthread: a worker keeps idle keep-alive connections without blocking a thread on them; threads
# overlap the time a request waits on PostgreSQL. --max-requests recycles a worker now and then
# (bounds any slow leak); the jitter keeps them from recycling together.
exec nice -n "$NICE" "$BIN/gunicorn" webapp.config.wsgi \
  --bind "$BIND" \
  --worker-class gthread \
  --workers "$WORKERS" \
  --threads "$THREADS" \
  --timeout "${OOLONG_WEB_TIMEOUT_S:-60}" \
  --graceful-timeout 30 \
  --keep-alive 5 \
  --max-requests 5000 --max-requests-jitter 500 \
  "$@"
