"""User API tokens moved to django-rest-knox (digests with an expiry). DRF's authtoken table held
every token in plaintext: it goes, with its tokens (users get new ones from
POST /api/auth/token/ or ``manage.py oolong_user``)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("accounts", "0002_project_quota"), ("knox", "0009_extend_authtoken_field")]

    operations = [migrations.RunSQL("DROP TABLE IF EXISTS authtoken_token",
                                    reverse_sql=migrations.RunSQL.noop)]
