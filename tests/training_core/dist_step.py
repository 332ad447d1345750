"""Run under torch.distributed.run: one training step on this rank's shard of a fixed batch, then
rank 0 exports the weights to argv[2]. Used by test_train_distributed.py."""

import json
import sys

import torch

from tests.training_core.trainer.test_deepspeed_trainer import _batch
from training_core.algorithms.loss import decoupled_ppo_loss
from training_core.algorithms.presets import PRESETS
from training_core.train import scatter_batch
from training_core.trainer.deepspeed_trainer import DeepSpeedTrainer
from training_core.world import finish_distributed, rank_and_world


def main(model_dir: str, out: str, zero_stage: int) -> None:
    torch.manual_seed(0)
    t = DeepSpeedTrainer(model_dir, lr=1e-3, weight_decay=0.0, grad_clip=1e9, zero_stage=zero_stage)
    _, world = rank_and_world()
    full = _batch(n=6, seed=5)
    shard = scatter_batch(full if rank_and_world()[0] == 0 else None, world)
    prox = t.logprobs(shard)
    shard.behav_logp = prox.clone()
    stats = t.train_step(shard, prox, lambda *a, **k: decoupled_ppo_loss(*a, cfg=PRESETS["grpo"], **k))
    path = t.save_weights(out)
    if rank_and_world()[0] == 0:  # global values: scale-sensitive, unlike Adam's weight update
        (path / "stats.json").write_text(json.dumps({"loss": stats["loss"], "tokens": stats["tokens"]}))
    finish_distributed()  # an exit-time abort of one rank would fail the launcher


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
