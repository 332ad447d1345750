import pytest
import torch

from training_core.algorithms.presets import PRESETS
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
