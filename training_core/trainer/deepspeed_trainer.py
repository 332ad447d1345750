"""The trainer engine on DeepSpeed: logprob recompute, a policy update, weight export, checkpoints.

The loss is injected (``loss_fn``), so algorithms never subclass the engine. Micro-batches are
packed by a token budget and gradients accumulate in DeepSpeed's unmanaged mode
(``managed_gradient_accumulation: false``): backward() only accumulates and the one step() per
minibatch is the boundary, so a variable number of micro-batches needs no fixed GAS.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training_core import world as world_
from training_core.api import NonFiniteUpdate, TrainBatch
from training_core.checkpoint import COMPLETE
from training_core.config import LoraSpec
from training_core.dtypes import DEFAULT_DTYPE, precision, torch_dtype
from training_core.gpu_memory import LOGIT_CHUNK_TOKENS
from training_core.models.loading import load_model
from training_core.optim import adamw, keep_fused
from training_core.prefix_tree import (
    prefix_micro_batches,
    prefix_tree_logprobs,
    sequence_logprobs,
)
from training_core.proximal import update_gives_proximal
from training_core.trainer import adapter
from training_core.transport import weight_files
from training_core.world import barrier, init_distributed, local_rank, rank_and_world


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices (longest first) so each padded micro-batch fits ``token_budget`` and
    no sample is padded to more than twice its length (long-tailed lengths would otherwise make
    most of a micro-batch padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (longest * (len(current) + 1) > token_budget or 2 * lengths[i] < longest):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout: ``nn.Dropout`` modules and the float ``*dropout*`` attributes that
    attention implementations read (Llama's ``attention_dropout``), and the config's."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    for name, value in list(vars(model.config).items()):
        if "dropout" in name and isinstance(value, float):
            setattr(model.config, name, 0.0)


class DeepSpeedTrainer:
    def __init__(self, model_dir: str | Path, *, lr: float, weight_decay: float, grad_clip: float,
                 zero_stage: int, dtype: str = DEFAULT_DTYPE, dist_backend: str = "auto",
                 temperature: float = 1.0, micro_batch_tokens: int = 8192, keep_reference: bool = False,
                 share_prefixes: bool = True, activation_checkpointing: bool = False,
                 logit_chunk_tokens: int | None = LOGIT_CHUNK_TOKENS, lora: LoraSpec | None = None):
        import deepspeed

        init_distributed(dist_backend)
        self.device = torch.device("cuda", local_rank()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self.temperature = temperature
        self.micro_batch_tokens = micro_batch_tokens
        self.zero_stage = zero_stage
        self.share_prefixes = share_prefixes
        # Logits of at most this many tokens exist at once (prefix_tree's module doc); None:
        # the full [T, V] logits (benchmarks/trainer_memory.py measures the difference).
        self.logit_chunk_tokens = logit_chunk_tokens
        # bfloat16: fp32 master weights and optimizer, matmuls in bf16 under autocast
        # (DeepSpeed's torch_autocast mode; norms, softmax and the loss stay fp32). Weights held
        # in bf16 would lose updates smaller than 2^-8 of a weight: Adam's steps at RL learning
        # rates mostly are. float16 keeps DeepSpeed's fp16 mode (half weights, loss scaling).
        mode = precision(dtype)  # how each dtype trains: training_core/dtypes.py
        self.autocast = mode.autocast is not None
        # The servers serve in the run's dtype: a bf16 run's fp32 master weights go out in bf16,
        # half the bytes to copy, send and load (the servers would cast them on load anyway).
        self.serve_dtype = torch_dtype(mode.name) if mode.trainer_weights != mode.name else None
        weights_dtype = mode.trainer_weights
        model = load_model(model_dir, weights_dtype).to(self.device)
        model.config.use_cache = False
        # The proximal logprobs are computed in eval mode and the update in train mode: with
        # dropout on, the PPO ratio would not start at 1 (AReaL turns dropout off as well).
        disable_dropout(model)
        if activation_checkpointing:
            # Each decoder layer keeps only its input and recomputes the rest in the backward
            # (about a third more compute for activations of one layer instead of all). Only in
            # train mode: the no-grad logprob passes run eval and keep nothing anyway.
            # Non-reentrant: it needs no input that requires grad and works under ZeRO-3.
            # transformers renamed the call (the old name warns from 5.2x, goes in 6).
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.lora = lora
        self.reference = None
        if lora is not None:  # [issue 49] only the adapter trains; the base is frozen
            model = adapter.wrap(model, lora)
            if keep_reference:  # the reference is the base: the adapter switched off, no copy
                self.reference = adapter.BaseOnly(model)
        elif keep_reference:  # frozen copy of the initial policy for KL-regularised presets
            self.reference = load_model(model_dir, weights_dtype).to(self.device).eval()
            disable_dropout(self.reference)
            self.reference.requires_grad_(False)
        # Only what trains: with an adapter the optimizer's state is the adapter's, nothing else.
        optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "torch_autocast": {"enabled": self.autocast, "dtype": mode.autocast} if self.autocast
            else {"enabled": False},
            "fp16": {"enabled": mode.fp16_mode},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config)
        if zero_stage == 0 and rank_and_world()[1] == 1:
            # One rank has nothing to reduce, yet DeepSpeed's stage-0 path still flattens every
            # gradient into one buffer and copies it back: 0.3 of SmolLM2's 0.45 s optimizer step.
            self.engine.enable_backward_allreduce = False

    # ---- forward passes ---------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Recompute per-token logprobs (the proximal policy, or the reference with ``model``)."""
        if isinstance(model, adapter.BaseOnly):
            with model.peft_model.disable_adapter():
                return self.logprobs(batch, model.peft_model)
        net = model or self.engine.module
        was_training = net.training
        net.eval()
        out = torch.zeros_like(batch.behav_logp)
        for idx in self._micro_batches(batch):
            lp = self._forward_logprobs(net, batch.select(idx)).cpu()
            out[torch.tensor(idx), : lp.shape[1]] = lp
        net.train(was_training)
        return out

    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        if self.share_prefixes:
            return prefix_micro_batches(batch.input_ids, batch.lengths, self.micro_batch_tokens)
        return pack_micro_batches(batch.lengths, self.micro_batch_tokens)

    def _forward_logprobs(self, net: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
        # The same autocast for every forward: the proximal and reference passes run the bare
        # module (DeepSpeed autocasts only its engine's forward), and a proximal pass in other
        # numerics than the update's would move the PPO ratio off 1.
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self._forward_logprobs_as_is(net, mb)

    def _forward_logprobs_as_is(self, net: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
        # One forward per micro-batch either way (under ZeRO-3 every forward is a collective).
        if mb.temperatures is not None:  # per token (an agent's own): rows whole, each token
            temps = mb.temperatures.to(self.device)  # at the temperature it was sampled at
            temps = torch.where(temps > 0, temps, torch.full_like(temps, self.temperature))
            return sequence_logprobs(net, mb.input_ids.to(self.device),
                                     mb.attention_mask.to(self.device), temps[:, 1:, None],
                                     self.logit_chunk_tokens)
        if self.share_prefixes:
            return prefix_tree_logprobs(net, mb.input_ids.to(self.device),
                                        mb.attention_mask.to(self.device), mb.versions,
                                        self.temperature, self.logit_chunk_tokens)
        return sequence_logprobs(net, mb.input_ids.to(self.device),
                                 mb.attention_mask.to(self.device), self.temperature,
                                 self.logit_chunk_tokens)

    def train_step(self, batch: TrainBatch, prox_logp: torch.Tensor | None,
                   loss_fn: Callable[..., Any], *, minibatches: int = 1,
                   ref_logp: torch.Tensor | None = None,
                   compute_rows: list[int] | None = None,
                   before_micro_batch: Callable[[], None] | None = None) -> dict[str, float]:
        """One PPO pass over ``batch`` split in ``minibatches`` optimizer steps.

        ``loss_fn(logp, prox, behav, adv, mask, num_tokens=..., ref_logp=...) -> (loss, stats)``.
        The loss of every micro-batch is normalised by the minibatch's total output tokens so the
        accumulated gradient is a token mean over the (global) minibatch.

        ``prox_logp=None``: the proximal policy is the policy before this update, and every
        forward of the first minibatch runs before its optimizer step, so the update's own
        logprobs, detached, are the proximal logprobs exactly (no separate pass; TRL does the
        same for on-policy steps). Only a later minibatch needs them computed beforehand.

        ``compute_rows``: the rows whose loss can have a gradient (``batching.rows_with_gradient``;
        None: all). The others get no forward or backward and still count in their minibatch's
        token-mean denominator, so the gradient is the same. A minibatch with none still computes
        one row (its gradient is exactly zero): AdamW must step on zero gradients, not on none, and
        every rank takes part in the reduction. Under ZeRO-3 with several ranks every forward is a
        collective, so every row is computed there. The stats' ``computed_tokens`` are the output
        tokens that went through the loss (behaviour-weight means are over those).

        ``before_micro_batch`` runs before each micro-batch (the trainer re-balances its threads
        there, see train.ThreadShare).
        """
        if prox_logp is None and not update_gives_proximal(minibatches):
            raise ValueError("with several minibatches the proximal logprobs must be computed "
                             "before the first optimizer step")
        if prox_logp is None and self.lora is not None and self.lora.dropout > 0:
            # The update's forward drops adapter inputs, so its logprobs are not the policy's:
            # the proximal ones take their own pass in eval mode (the first ratio stays 1).
            prox_logp = self.logprobs(batch)
        self.engine.train()
        n = batch.input_ids.shape[0]
        order = list(range(n))
        chunks = [order[i::minibatches] for i in range(minibatches) if order[i::minibatches]]
        totals = {"loss": 0.0, "tokens": 0.0, "computed_tokens": 0.0, "clipped": 0.0,
                  "behav_weight_sum": 0.0, "behav_weight_max": 0.0, "behav_masked": 0.0,
                  "kl_sum": 0.0, "grad_norm": 0.0, "computed_rows": 0.0}
        # Where the update's time goes (metrics time/forward_s ...; this rank's own clock).
        clock = {"time/forward_s": 0.0, "time/backward_s": 0.0, "time/optimizer_s": 0.0}
        rank, world = rank_and_world()
        if world > 1 and len(chunks) != minibatches:
            raise ValueError(f"rank {rank} got {n} samples for {minibatches} minibatches: every rank "
                             "needs at least one sample per minibatch")
        wanted = None if compute_rows is None or (self.zero_stage == 3 and world > 1) \
            else set(compute_rows)
        # [issue 47] Nothing non-finite reaches the weights: advantages are checked before any
        # forward, loss and gradients before each optimizer step (update_refused, below).
        self._refuse_if(not bool(torch.isfinite(batch.advantages).all()), "advantages", world)
        for chunk in chunks:
            finite_loss = True
            num_tokens = float(batch.loss_mask[torch.tensor(chunk)].sum())
            totals["tokens"] += num_tokens
            if world > 1:
                # DeepSpeed averages gradients over ranks; normalising each rank's sum by
                # (global tokens / world) makes that average the global token mean.
                num_tokens = world_.all_reduce_sum([num_tokens])[0] / world
            kept = chunk if wanted is None else [r for r in chunk if r in wanted] or chunk[:1]
            totals["computed_rows"] += len(kept)
            sub = batch.select(kept)
            for idx in self._micro_batches(sub):
                if before_micro_batch is not None:
                    before_micro_batch()
                mb = sub.select(idx)
                rows = torch.tensor([kept[i] for i in idx])
                width = mb.input_ids.shape[1]
                started = time.perf_counter()
                logp = self._forward_logprobs(self.engine, mb)
                prox = (logp.detach() if prox_logp is None
                        else prox_logp[rows, :width].to(self.device))
                loss, stats = loss_fn(
                    logp, prox, mb.behav_logp.to(self.device),
                    mb.advantages.to(self.device), mb.loss_mask.to(self.device),
                    num_tokens=num_tokens,
                    ref_logp=None if ref_logp is None else ref_logp[rows, :width].to(self.device),
                )
                forwarded = time.perf_counter()
                clock["time/forward_s"] += forwarded - started
                self.engine.backward(loss, scale_wrt_gas=False)
                clock["time/backward_s"] += time.perf_counter() - forwarded
                finite_loss &= bool(torch.isfinite(loss.detach()))
                totals["loss"] += float(loss.detach())
                totals["computed_tokens"] += stats.tokens
                totals["clipped"] += stats.clipped
                totals["behav_weight_sum"] += stats.behav_weight_sum
                totals["behav_weight_max"] = max(totals["behav_weight_max"], stats.behav_weight_max)
                totals["behav_masked"] += stats.behav_masked
                totals["kl_sum"] += stats.kl_sum
            started = time.perf_counter()
            if not self.engine.enable_backward_allreduce:
                self._zero_missing_grads()
            local_norm = self._grad_norm()  # before step(): it clips and zeroes the grads
            self._refuse_if(not (finite_loss and np.isfinite(local_norm)),
                            "loss" if not finite_loss else "gradient", world)
            self.engine.step()
            clock["time/optimizer_s"] += time.perf_counter() - started
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else local_norm
            totals["grad_norm"] = max(totals["grad_norm"], norm)
        if world > 1:  # metrics describe the global batch
            keys = ["loss", "tokens", "computed_tokens", "clipped", "behav_weight_sum",
                    "behav_masked", "kl_sum", "computed_rows"]
            summed = world_.all_reduce_sum([totals[k] for k in keys])
            totals.update(dict(zip(keys, summed, strict=True)))
            totals["loss"] /= world
        return {**totals, **clock}

    def _refuse_if(self, bad: bool, what: str, world: int) -> None:
        """[issue 47] Raise NonFiniteUpdate on every rank (the verdict is all-reduced: every
        rank skips the same step) after dropping the accumulated gradients, so the optimizer
        never steps on a NaN or inf and the next update starts clean."""
        if world > 1:
            mine, bad = bad, world_.all_reduce_max([1.0 if bad else 0.0])[0] > 0
            what = what if mine else "values on another rank"
        if not bad:
            return
        for p in self.engine.module.parameters():
            p.grad = None
        zero_grad = getattr(self.engine.optimizer, "zero_grad", None)
        if zero_grad is not None:
            zero_grad()
        raise NonFiniteUpdate(f"non-finite {what} in this update: the optimizer step was refused "
                              "(nothing applied, nothing pushed)")

    def _zero_missing_grads(self) -> None:
        """What DeepSpeed's reduction does, for the single rank that skips it: a trainable
        parameter the loss did not reach gets a zero gradient, so AdamW still steps it (weight
        decay, moments), as every rank of a multi-rank run does."""
        for p in self.engine.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _grad_norm(self) -> float:
        # DeepSpeed reports no norm in unmanaged accumulation with ZeRO 0; ZeRO >= 1 keeps grads
        # in its partitions and reports it after step() instead.
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters()
                 if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    # ---- weights and checkpoints ------------------------------------------------------------

    def weights(self, *, cast: bool = True) -> dict[str, torch.Tensor]:
        """The full weights the rollout servers load, in ``state_dict`` order, on the trainer's
        device and in the dtype the servers serve (bf16 runs: a bf16 copy of the fp32 master
        weights; ``cast=False``: fp32 views where no copy is made anyway, for a writer that casts
        on its way to disk); a tied ``lm_head.weight`` is left out (the servers re-tie on load).
        A collective under ZeRO-3 (every rank gathers and gets copies); under ZeRO 0-2 views of
        the live parameters, valid until the next update."""
        module = self.engine.module
        cast_to = self.serve_dtype
        if self.zero_stage == 3:
            import deepspeed

            # One copy each, already in the served dtype: the gathered tensors go at block's end.
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = {k: v.detach().to(cast_to or v.dtype, copy=True)
                         for k, v in module.state_dict().items()}
        else:
            state = {k: v.detach() if cast_to is None or not cast else v.detach().to(cast_to)
                     for k, v in module.state_dict().items()}
        if self.tied:
            state.pop("lm_head.weight", None)
        return state

    def adapter_weights(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """[issue 49] A LoRA run's adapter as the servers take it over the weight group: its
        tensors in the served dtype on this rank's device (whole: ZeRO 0-2 hold every
        parameter on every rank) and its peft config; None for a full fine-tuning run."""
        if self.lora is None:
            return None
        return adapter.state(self.engine.module, dtype=self.serve_dtype)

    def save_weights(self, path: str | Path, *, spare: str | Path | None = None) -> Path:
        """Write safetensors the rollout servers load (whole or not at all); over ``spare``'s
        file where it can be reused (weight_files.save)."""
        if self.lora is not None:  # [issue 49] the adapter only, in peft's layout
            if rank_and_world()[0] != 0:
                return Path(path)
            return adapter.save(self.engine.module, path, dtype=self.serve_dtype)
        state = self.weights(cast=False)  # every rank takes part (ZeRO-3 gathers)
        if rank_and_world()[0] != 0:
            return Path(path)
        return weight_files.save(path, state, dtype=self.serve_dtype, spare=spare)

    def save_checkpoint(self, ckpt_dir: str | Path, tag: str, client_state: dict[str, Any]) -> Path:
        state = dict(client_state)
        state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(),
                        "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        # With an adapter the frozen base is not saved: it is the model folder, unchanged.
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state,
                                    exclude_frozen_parameters=self.lora is not None)
        barrier()
        # The marker is written last: a checkpoint without it was interrupted and is ignored.
        # One per node (its first local rank): each node's run directory holds its own shards.
        if local_rank() == 0:
            (Path(ckpt_dir) / tag / COMPLETE).write_text("ok")
        return Path(ckpt_dir) / tag

    def load_checkpoint(self, ckpt_dir: str | Path, tag: str) -> dict[str, Any]:
        _, state = self.engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True,
                                               load_lr_scheduler_states=True,
                                               load_module_strict=self.lora is None)
        keep_fused(self.engine.optimizer)
        rng = state.pop("rng", None)
        if rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        return state
