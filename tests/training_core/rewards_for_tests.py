"""Custom rewards loaded by import path in tests (they run in the reward worker processes)."""

import time


def length_reward(completion: str, item: dict) -> float:
    """Varies between samples of one prompt, so even an untrained model gets advantages."""
    return len(completion) / 10.0


def raises(completion: str, item: dict) -> float:
    raise RuntimeError("user reward bug")


def sleeps(completion: str, item: dict) -> float:
    time.sleep(60)
    return 1.0


def digit_reward(completion: str, item: dict) -> float:
    """The fraction of digits: random completions differ, so every group has advantages."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def needs_700_mb(completion: str, item: dict) -> float:
    """Allocates 700 MB of address space (calloc'd, not touched): within reward.memory_mb's
    default, beyond 512; the address-space limit refuses it, whatever memory the machine has."""
    block = bytearray(700 << 20)
    return float(len(block) > 0)


def sleeps_3_s(completion: str, item: dict) -> float:
    time.sleep(3)
    return 1.0
