import pytest
import torch

from training_core.algorithms.presets import PRESETS, AlgorithmConfig
from training_core.api import Trajectory, TrajectoryGroup
from training_core.batching import build_train_batch

pytestmark = pytest.mark.unit  # no process, network or database (conftest)


def test_padded_tensors_and_token_level_advantages():
    a = Trajectory([5, 6, 7], [0, 1, 1], [0.0, -0.1, -0.2], [-1, 0, 1], reward=1.0)
    b = Trajectory([5, 6], [0, 1], [0.0, -0.3], [-1, 1], reward=0.0)
    batch = build_train_batch([TrajectoryGroup([a, b])], pad_id=0, algo=PRESETS["dr_grpo"],
                              max_new_tokens=8)
    assert batch.input_ids.tolist() == [[5, 6, 7], [5, 6, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.versions.tolist() == [[-1, 0, 1], [-1, 1, -1]]
    assert torch.allclose(batch.behav_logp, torch.tensor([[0.0, -0.1, -0.2], [0.0, -0.3, 0.0]]))
    # Dr.GRPO: rewards 1, 0 -> advantages +0.5, -0.5 on output tokens only
    assert torch.allclose(batch.advantages, torch.tensor([[0.0, 0.5, 0.5], [0.0, -0.5, 0.0]]))


def test_overlong_penalty_judges_each_turn_not_the_whole_trajectory():
    # Two turns of 4 tokens each (feedback between them, loss mask 0) against a per-turn budget
    # of 8 with a 4-token window (tokens 5 to 8): neither turn enters the window, so no penalty,
    # although the trajectory has 8 output tokens. A single 8-token answer is at the limit: full
    # penalty.
    algo = AlgorithmConfig(normalize_std=False, overlong_buffer=0.5, overlong_penalty=1.0)
    two_turns = [0] + [1] * 4 + [0, 0] + [1] * 4
    a = Trajectory([1] * len(two_turns), two_turns, [0.0] * len(two_turns),
                   [-1] * len(two_turns), reward=1.0)
    long = [0] + [1] * 8
    b = Trajectory([1] * len(long), long, [0.0] * len(long), [-1] * len(long), reward=1.0)
    batch = build_train_batch([TrajectoryGroup([a, b])], pad_id=0, algo=algo, max_new_tokens=8)
    # shaped rewards 1 and 0: advantages +0.5 and -0.5 (no std)
    assert batch.advantages[0, 1].item() == 0.5
    assert batch.advantages[1, 1].item() == -0.5
