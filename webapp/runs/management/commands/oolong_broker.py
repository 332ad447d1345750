"""Prepare the Celery broker before a worker and the web app start on it: `manage.py oolong_broker`."""

from django.core.management.base import BaseCommand

from webapp.config.celery import broker_prepare


class Command(BaseCommand):
    help = ("Declare the task queues on the broker (idempotent). Run it once before starting a worker and "
            "the web app together on a fresh local SQLite broker, whose queue creation is not safe across processes.")

    def handle(self, **options):
        names = broker_prepare()
        if options["verbosity"] > 0:
            self.stdout.write("broker ready: " + ", ".join(names))
