"""The engines implement the contracts of training_core/api.py, member by member: the loop,
weight sync and evaluation are typed on the contracts, so a renamed method or keyword in an
engine must fail here, not in the middle of a run."""

from __future__ import annotations

import inspect

import pytest

from training_core import api
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer
from training_core.transport.rollout_client import RolloutClient

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def _members(protocol: type) -> dict[str, object]:
    names = set()
    for klass in protocol.__mro__:
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
        names |= set(getattr(klass, "__annotations__", {}))
    return {n: inspect.getattr_static(protocol, n, None) for n in names}


def _parameters(fn: object) -> list[tuple[str, object]]:
    fn = fn.fget if isinstance(fn, property) else fn
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("protocol", "implementation"), [
    (api.InferenceEngine, RolloutClient),
    (api.WeightReceiver, RolloutClient),
    (api.TrainEngine, DeepSpeedTrainer),
])
def test_an_engine_has_every_member_of_its_contract_with_the_same_parameters(protocol,
                                                                             implementation):
    annotated = set(getattr(implementation, "__annotations__", {}))
    source = inspect.getsource(implementation)
    for name, member in _members(protocol).items():
        if member is None:  # an attribute: set in __init__ (or annotated on the class)
            assert name in annotated or f"self.{name} =" in source, f"{implementation.__name__}.{name}"
            continue
        impl = inspect.getattr_static(implementation, name, None)
        assert impl is not None, f"{implementation.__name__} lacks {name}"
        assert isinstance(impl, property) == isinstance(member, property), name
        if not isinstance(member, property):
            assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(member), name
            assert _parameters(impl) == _parameters(member), name


def test_the_check_catches_a_renamed_keyword():
    class Renamed(RolloutClient):
        async def agenerate_group(self, request, count):  # 'n' renamed
            raise NotImplementedError

    with pytest.raises(AssertionError, match="agenerate_group"):
        test_an_engine_has_every_member_of_its_contract_with_the_same_parameters(
            api.InferenceEngine, Renamed)
