import random

import pytest

from training_core.staleness import StalenessManager

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def test_capacity_formula_by_hand():
    m = StalenessManager(batch_groups=2, max_staleness=1, max_concurrent=10)
    # (eta + v + 1) * B - (accepted + running) = (1 + 0 + 1) * 2 - 0 = 4
    assert m.capacity(0) == 4
    for _ in range(4):
        m.on_submitted()
    assert m.capacity(0) == 0
    m.on_accepted()
    m.on_accepted()
    assert m.capacity(0) == 0  # accepted + running is unchanged by acceptance
    assert m.capacity(1) == 2  # (1 + 1 + 1) * 2 - 4


def test_concurrency_bound_wins_when_smaller():
    m = StalenessManager(batch_groups=8, max_staleness=4, max_concurrent=3)
    assert m.capacity(0) == 3
    m.on_submitted()
    assert m.capacity(0) == 2


def test_rejection_frees_a_slot():
    m = StalenessManager(batch_groups=2, max_staleness=0, max_concurrent=10)
    m.on_submitted()
    m.on_submitted()
    assert m.capacity(0) == 0
    m.on_rejected()
    assert m.capacity(0) == 1
    assert m.stats().rejected == 1


def test_staleness_zero_is_synchronous():
    m = StalenessManager(batch_groups=2, max_staleness=0, max_concurrent=100)
    assert m.capacity(0) == 2
    m.on_submitted(), m.on_submitted(), m.on_accepted(), m.on_accepted()
    assert m.capacity(0) == 0, "batch 1 must not start before version 1 exists"
    assert m.capacity(1) == 2


def test_recover_restores_accepted_from_version():
    m = StalenessManager(batch_groups=2, max_staleness=1, max_concurrent=10)
    m.recover(3)
    assert m.stats().accepted == 6 and m.stats().running == 0
    assert m.capacity(3) == (1 + 3 + 1) * 2 - 6


def test_invalid_arguments():
    with pytest.raises(ValueError):
        StalenessManager(batch_groups=0, max_staleness=0, max_concurrent=1)


def _simulate(eta, in_order, seed=0):
    rng = random.Random(seed + eta)
    B = 3
    m = StalenessManager(batch_groups=B, max_staleness=eta, max_concurrent=7)
    version, running, accepted, consumed_lags = 0, [], [], []
    for _ in range(3000):
        while m.capacity(version) > 0:
            m.on_submitted()
            running.append(version)
        st = m.stats()
        # The invariant the formula maintains, whatever the completion order:
        assert st.accepted + st.running <= (eta + version + 1) * B
        if running and rng.random() < 0.7:
            started = running.pop(0 if in_order else rng.randrange(len(running)))
            if rng.random() < 0.1:
                m.on_rejected()
            else:
                m.on_accepted()
                accepted.append(started)
        if len(accepted) >= B:
            batch, accepted = accepted[:B], accepted[B:]
            consumed_lags += [version - s for s in batch]
            version += 1
    return consumed_lags


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_in_order_completion_never_exceeds_eta(eta):
    lags = _simulate(eta, in_order=True)
    assert len(lags) > 150 and max(lags) <= eta


def test_out_of_order_stragglers_can_exceed_eta():
    # Why the strict per-token bound at consume time exists (rollout.max_token_staleness): an
    # episode started early and finished late is consumed after more than eta versions.
    lags = _simulate(1, in_order=False)
    assert max(lags) > 1
    assert sum(lag <= 1 for lag in lags) / len(lags) > 0.5


def test_the_per_token_bound_drops_a_sample_one_version_past_its_last_chance():
    from training_core.staleness import last_chance, token_bound, too_stale

    assert token_bound(2, None) == 2 and token_bound(2, 0) == 0  # eta unless set
    # bound 1, batch taken at version 5: an oldest token from 4 stays, one from 3 leaves
    assert not too_stale(4, 5, 1) and too_stale(3, 5, 1)
    assert last_chance(4, 5, 1) and not last_chance(3, 5, 1) and not last_chance(5, 5, 1)
    # an episode whose last chance is now would be too stale in the next batch
    assert last_chance(4, 5, 1) and too_stale(4, 6, 1)
    assert not too_stale(0, 100, None) and not last_chance(0, 100, None)  # no per-token bound


def test_no_module_but_staleness_py_computes_with_a_staleness_bound():
    """The bound is written once: arithmetic or a comparison on max_staleness,
    max_token_staleness or token_staleness_bound elsewhere decides it a second time."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    names = {"max_staleness", "max_token_staleness", "token_staleness_bound"}

    def named(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in names) or \
            (isinstance(node, ast.Name) and node.id in names)

    found = []
    for top in ("training_core", "webapp", "workers", "platform"):
        for path in sorted((root / top).rglob("*.py")):
            if path.name == "staleness.py" or "tests" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                sides = [node.left, node.right] if isinstance(node, ast.BinOp) else \
                    [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
                if any(named(s) for s in sides):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []
