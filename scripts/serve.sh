#!/usr/bin/env bash
# The production web server as an operator runs it: migrations, then gunicorn serving the WSGI
# app with the production settings. Everything comes from the environment (docs/operations.md):
#   DJANGO_SECRET_KEY, DATABASE_URL (PostgreSQL), CELERY_BROKER_URL and DJANGO_CACHE_URL (Redis),
#   DJANGO_ALLOWED_HOSTS; OOLONG_WEB_BIND (default 127.0.0.1:8000), OOLONG_WEB_WORKERS (default
#   2 x cores + 1), OOLONG_WEB_THREADS (default 4), OOLONG_WEB_TIMEOUT_S (default 60).
# Extra arguments go to gunicorn (e.g. --access-logfile -).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${OOLONG_BIN:-.venv/bin}
export DJANGO_SETTINGS_MODULE=${DJANGO_SETTINGS_MODULE:-webapp.config.settings.production}

# The cache must be shared by every worker process: the login throttle counts in it.
if [ -z "${DJANGO_CACHE_URL:-}" ] && [ "$DJANGO_SETTINGS_MODULE" = webapp.config.settings.production ]; then
  echo "serve: set DJANGO_CACHE_URL (e.g. redis://127.0.0.1:6379/2): the worker processes share it" >&2
  exit 2
fi

"$BIN/python" manage.py migrate --noinput >/dev/null
# gthread: a worker keeps idle keep-alive connections without blocking a thread on them; threads
# overlap the time a request waits on PostgreSQL. --max-requests recycles a worker now and then
# (bounds any slow leak); the jitter keeps them from recycling together.
exec "$BIN/gunicorn" webapp.config.wsgi \
  --bind "${OOLONG_WEB_BIND:-127.0.0.1:8000}" \
  --worker-class gthread \
  --workers "${OOLONG_WEB_WORKERS:-$((2 * $(nproc) + 1))}" \
  --threads "${OOLONG_WEB_THREADS:-4}" \
  --timeout "${OOLONG_WEB_TIMEOUT_S:-60}" \
  --graceful-timeout 30 \
  --keep-alive 5 \
  --max-requests 5000 --max-requests-jitter 500 \
  "$@"
