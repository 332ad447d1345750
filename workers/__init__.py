"""Celery workers: short jobs for the web app (thin, idempotent tasks over webapp services)."""
