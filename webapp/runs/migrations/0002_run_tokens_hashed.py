# Ingest tokens are kept as SHA-256 hashes in RunToken; existing plaintext tokens are carried over
# (hashed; revoked when their run already ended), then the plaintext column goes.

import hashlib

import django.db.models.deletion
from django.db import migrations, models
from django.utils import timezone

TERMINAL = ("succeeded", "failed", "cancelled")


def carry_tokens_over(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    RunToken = apps.get_model("runs", "RunToken")
    now = timezone.now()
    RunToken.objects.bulk_create([
        RunToken(run_id=run.id, token_hash=hashlib.sha256(run.ingest_token.encode()).hexdigest(),
                 purpose="creator", revoked_at=now if run.status in TERMINAL else None)
        for run in Run.objects.only("id", "ingest_token", "status").iterator()])


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='RunToken',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('token_hash', models.CharField(max_length=64, unique=True)),
                ('purpose', models.CharField(help_text='creator | orchestrator', max_length=20)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                ('revoked_at', models.DateTimeField(blank=True, null=True)),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='tokens', to='runs.run')),
            ],
        ),
        migrations.RunPython(carry_tokens_over, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='run',
            name='ingest_token',
        ),
    ]
