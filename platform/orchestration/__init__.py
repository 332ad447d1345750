"""Oolong orchestration: Prefect flows that provision nodes, launch rollout fleets and trainers,
supervise them and tear them down. Imported as ``orchestration`` (``platform/`` is on the path,
never a package: it would shadow the standard library's ``platform``).

Imports only ``training_core`` of ours; talks to the web app over its HTTP API.
"""
