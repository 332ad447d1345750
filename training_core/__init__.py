"""Oolong's RL engine: fully asynchronous RL for reasoning LLMs.

A pure library: imports torch, transformers, httpx, pydantic, never django, celery, prefect or
any other Oolong package. The training loop lives in :mod:`training_core.train`.
"""

__version__ = "0.1.0"
