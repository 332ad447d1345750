"""Create (or reuse) a user with an API token and a project: `manage.py oolong_user NAME PASSWORD`."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from webapp.accounts.models import Project
from webapp.accounts.services import (
    membership_add,
    project_create,
    token_get_or_create,
    user_create,
)


class Command(BaseCommand):
    help = "Create a user with an API token and a project (idempotent). Prints the token."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("password")
        parser.add_argument("--project", default="Demo")

    def handle(self, username, password, project, **options):
        User = get_user_model()
        user = User.objects.filter(username=username).first() or user_create(
            username=username, password=password)
        proj = Project.objects.filter(name=project).first()
        if proj is None:
            proj = project_create(user=user, name=project)
        else:
            membership_add(project=proj, user=user)
        self.stdout.write(f"{token_get_or_create(user=user)} {proj.id}")
