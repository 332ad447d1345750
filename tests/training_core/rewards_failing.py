"""A reward that fails on a known share of calls (it runs in the jailed reward worker, which
loads the module once, so the counter lives as long as the worker)."""

CALLS = [0]


def fails_every_third(completion: str, item: dict) -> float:
    """Raises on every third call: a third of the samples of a run with one reward worker."""
    CALLS[0] += 1
    if CALLS[0] % 3 == 0:
        raise ValueError("every third sample fails")
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
