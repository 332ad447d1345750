"""Workflows: one episode as one coroutine (``arun_episode(engine, item)``)."""
