"""Logprobs of a batch computed once per distinct prefix: the trainer's forward on a prefix forest.

A GRPO group is ``group_size`` answers to one prompt. Run as rows, every answer repeats the
prompt's compute; answers that start alike (a trained policy's often do) repeat their common
start; identical answers repeat everything. Here the samples of a micro-batch become a trie of
tokens (one node per distinct prefix), the tries are packed into rows, and one forward runs over
the nodes: each node at its depth as position, attending to its ancestors and itself. A node's
hidden states depend on its prefix only, so they equal those of every row that holds that
prefix, and the logprob of a sample's token is read from its parent node's logits: the same
numbers as :func:`sequence_logprobs`. Every copy's loss flows back into the one node, so the
gradients are the same too (up to float summation order).

Measured on the long-tail task's batches (64 answers, 8 prompts, one thread): 930 generated
tokens become ~670 nodes, and an update takes 0.065 s against 0.095 s with prompts shared by KV
and identical answers computed once (the two rules this replaces); with no two answers alike it
is no slower (0.093 s against 0.101 s).

Rows and their cost: a row holds whole prompt groups (first fit, largest first), and a group
whose trie outgrows the row budget is split, each part with its own copy of the prompt. The
budget is ``ROW_FACTOR`` times the longest sample, at most ``ROW_CAP`` nodes (never below the
longest sample): the attention mask is dense ([rows, 1, W, W] booleans), so a wider row costs
quadratically more in attention and mask memory, while a narrower one shares less.

The embedded server's prefill uses the same forest (:func:`prefill_forest`): sequences joining
its decode batch, each distinct prefix computed once, with no padding.

Logits in chunks: the full ``[T, V]`` fp32 logits of a micro-batch are 5 GB at 8k tokens and a
152k vocabulary (THUDM/slime#2253), and autograd would keep them until the backward. So the
forward stops at the hidden states (the model runs with its output projection set aside), and
the logprob of each token is computed from them through the projection ``chunk_tokens`` rows at
a time; with a gradient and more than one chunk, each chunk is recomputed in the backward
(``torch.utils.checkpoint``) instead of kept. At most one chunk's logits exist at once: the same
numbers (the rows are the same dot products), one more projection per chunk in the backward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from training_core.api import PROMPT_VERSION
from training_core.gpu_memory import LOGIT_CHUNK_TOKENS

log = logging.getLogger("oolong.trainer")

ROW_FACTOR = 3  # measured: 2 / 3 / 4 x the longest sample gave 0.076 / 0.073 / 0.072 s
ROW_CAP = 4096
# Attention implementations that take a prepared 4D mask; others run the rows whole.
MASKED_ATTENTION = ("sdpa", "eager")
FULL, SLIDING = "full_attention", "sliding_attention"
# Model families whose causal-LM forward is ``lm_head(hidden)`` and nothing after (read in
# transformers' modeling files): the chunked path computes exactly that. Others (Gemma 2's soft
# cap, Cohere's and Granite's logit scales) take the full logits.
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                               "phi3", "gemma", "olmo2", "smollm3"})


class UnsupportedAttention(ValueError):
    """A model whose layers' attention a prepared mask cannot express (e.g. chunked)."""


def sliding_window(config: object) -> int | None:
    """The attention window of the model's sliding-window layers; None when none has one."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or getattr(config, "use_sliding_window", True) is False or (
            types is not None and SLIDING not in types):
        return None
    return int(window)


def layer_masks(config: object, allowed: torch.Tensor,
                distance: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` to pass with a prepared 4D boolean mask: ``allowed`` itself, or
    with the model's sliding window applied. transformers uses a prepared mask as it is, so a
    window left out here is not applied at all (a Mistral-shaped model then attends past its
    window). ``distance``: query position minus key position, broadcastable to ``allowed``; a
    key is inside the window when distance < window, as transformers' own sliding mask has it.
    Models mixing full and sliding layers (Qwen2's ``layer_types``) get one mask per kind."""
    window = sliding_window(config)
    if window is None:
        return allowed
    near = allowed & (distance < window)
    types = getattr(config, "layer_types", None)
    if types is None or all(t == SLIDING for t in types):
        return near
    unknown = set(types) - {FULL, SLIDING}
    if unknown:
        raise UnsupportedAttention(f"layer types {sorted(unknown)} take no prepared mask")
    return {FULL: allowed, SLIDING: near}


def generation_starts(attention_mask: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    """Each row's first generated column (``versions != PROMPT_VERSION``); its length when it
    has none. Logprobs are computed from there on."""
    generated = (versions != PROMPT_VERSION) & attention_mask.bool()
    return torch.where(generated.any(-1), generated.long().argmax(-1), attention_mask.sum(-1))


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float | torch.Tensor,
                      chunk_tokens: int | None = LOGIT_CHUNK_TOKENS) -> torch.Tensor:
    """logp[:, t] = log pi(input_ids[:, t] | input_ids[:, :t]); column 0 is 0. Every row whole.
    ``temperature``: one, or one per predicted token ([N, L - 1, 1]). ``chunk_tokens``: logits
    of at most that many tokens at once (module doc); None: the full logits, the reference."""
    targets = input_ids[:, 1:]
    head = output_head(model) if chunk_tokens else None
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = logits[:, :-1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        with _without_head(model, head):
            hidden = model(input_ids=input_ids, attention_mask=attention_mask,
                           use_cache=False).logits
        n, length = targets.shape
        temps = temperature.reshape(-1, 1) if isinstance(temperature, torch.Tensor) else temperature
        logp = chunked_logprobs(head, hidden[:, :-1].reshape(n * length, -1),
                                targets.reshape(-1), temps, chunk_tokens).view(n, length)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's output projection when its logits are that projection of the last hidden
    states and nothing more (:data:`PLAIN_HEAD_MODELS`); None otherwise."""
    net = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    config = getattr(net, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODELS:
        return None
    get = getattr(net, "get_output_embeddings", None)
    return get() if get is not None else None


@contextmanager
def _without_head(model: torch.nn.Module, head: torch.nn.Module) -> Iterator[None]:
    """The model's forward with its output projection set aside: ``.logits`` are then the last
    hidden states. The forward still goes through the model (a DeepSpeed engine's forward
    registers the hooks its ZeRO backward starts from, on the output)."""
    net = getattr(model, "module", model)
    name = next(n for n, m in net.named_modules() if m is head)
    parent_name, _, attr = name.rpartition(".")
    parent = net.get_submodule(parent_name) if parent_name else net
    setattr(parent, attr, torch.nn.Identity())
    try:
        yield
    finally:
        setattr(parent, attr, head)


def _picked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float | torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float | torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """log_softmax(head(hidden) / temperature)[k, targets[k]] for the K rows of ``hidden``
    ([K, H]), ``chunk_tokens`` rows of logits at a time. ``temperature``: one, or one per row
    ([K, 1]). With a gradient and several chunks each chunk's logits are recomputed in the
    backward, so none is kept from the forward."""
    count = hidden.shape[0]
    keep = not (torch.is_grad_enabled() and hidden.requires_grad and count > chunk_tokens)
    parts = []
    for start in range(0, count, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        temp = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        if keep:
            parts.append(_picked_logprobs(head, hidden[rows], targets[rows], temp))
        else:
            parts.append(checkpoint(_picked_logprobs, head, hidden[rows], targets[rows], temp,
                                    use_reentrant=False))
    if not parts:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def prefix_micro_batches(input_ids: torch.Tensor, lengths: list[int],
                         token_budget: int) -> list[list[int]]:
    """Micro-batches for the prefix forest: samples in token order (a prompt's samples side by
    side, alike answers next to each other), cut where their summed lengths would pass
    ``token_budget``. A forest has at most that many nodes; padding plays no part, so no rule
    against mixing long and short samples is needed, and a group stays whole where it fits."""
    rows = input_ids.tolist()
    order = sorted(range(len(rows)), key=lambda i: rows[i][: lengths[i]])
    batches: list[list[int]] = []
    total = 0
    for i in order:
        if batches and total + lengths[i] <= token_budget:
            batches[-1].append(i)
            total += lengths[i]
        else:
            batches.append([i])
            total = lengths[i]
    return batches


class _Trie:
    """Nodes in creation order. Paths added in lexicographic order create them in depth-first
    preorder, so every node's subtree is the contiguous range [node, end)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self._children: dict[tuple[int, int], int] = {}

    def new_nodes(self, path: list[int]) -> int:
        node, depth = -1, 0
        while depth < len(path) and (node, path[depth]) in self._children:
            node = self._children[(node, path[depth])]
            depth += 1
        return len(path) - depth

    def add(self, path: list[int]) -> list[int]:
        """The node of each prefix of ``path`` (created where missing)."""
        node, nodes = -1, []
        for depth, token in enumerate(path):
            child = self._children.get((node, token))
            if child is None:
                child = len(self.tokens)
                self._children[(node, token)] = child
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(depth)
            nodes.append(child)
            node = child
        return nodes

    def subtree_ends(self) -> list[int]:
        ends = [k + 1 for k in range(len(self.tokens))]
        for k in reversed(range(len(self.tokens))):
            if self.parents[k] >= 0:
                ends[self.parents[k]] = max(ends[self.parents[k]], ends[k])
        return ends


@dataclass
class PrefixForest:
    """The forward's inputs and how to read every sample's logprobs back from it."""

    input_ids: torch.Tensor  # [R, W] node tokens (0 in padding)
    position_ids: torch.Tensor  # [R, W] node depths
    allowed: torch.Tensor  # [R, 1, W, W] bool: query node may attend to key node
    parents: torch.Tensor  # [K] flat node index (r * W + w) whose logits predict node k
    targets: torch.Tensor  # [K] node k's token
    pick: torch.Tensor  # [T] which of the K nodes each generated token of the batch is
    rows: torch.Tensor  # [T] its sample
    cols: torch.Tensor  # [T] its column


_Unit = tuple[_Trie, dict[int, list[int]]]  # a trie and each of its sequences' node path


def _units(groups: list[list[int]], seqs: list[list[int]], budget: int) -> list[_Unit]:
    """One trie per group of sequence indices, split where it would pass ``budget`` nodes (each
    part then holds its own copy of the shared prefix)."""
    units: list[_Unit] = []
    for members in groups:
        members = sorted(members, key=lambda i: seqs[i])
        trie, paths = _Trie(), {}
        for i in members:
            if paths and len(trie.tokens) + trie.new_nodes(seqs[i]) > budget:
                units.append((trie, paths))
                trie, paths = _Trie(), {}
            paths[i] = trie.add(seqs[i])
        units.append((trie, paths))
    return units


@dataclass
class _Layout:
    tokens: torch.Tensor  # [R, W]
    depths: torch.Tensor  # [R, W]
    allowed: torch.Tensor  # [R, 1, W, W]
    node_of: dict[int, tuple[int, list[int]]]  # sequence -> (flat offset of its unit, its path)


def _layout(units: list[_Unit], budget: int) -> _Layout:
    """Pack units into rows (first fit, largest first; a unit's nodes stay together, in
    preorder) and build the ancestor mask."""
    width_cap = max(budget, max(len(trie.tokens) for trie, _ in units))
    rows: list[list[_Unit]] = []
    fill: list[int] = []
    for unit in sorted(units, key=lambda u: -len(u[0].tokens)):
        size = len(unit[0].tokens)
        target = next((r for r, used in enumerate(fill) if used + size <= width_cap), None)
        if target is None:
            rows.append([])
            fill.append(0)
            target = len(rows) - 1
        rows[target].append(unit)
        fill[target] += size

    width = max(fill)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    depths = torch.zeros(len(rows), width, dtype=torch.long)
    ends = torch.arange(1, width + 1).repeat(len(rows), 1)  # padding: itself only
    node_of: dict[int, tuple[int, list[int]]] = {}
    for r, row_units in enumerate(rows):
        offset = 0
        for trie, paths in row_units:
            for i, path in paths.items():
                node_of[i] = (r * width + offset, path)
            m = len(trie.tokens)
            tokens[r, offset: offset + m] = torch.tensor(trie.tokens)
            depths[r, offset: offset + m] = torch.tensor(trie.depths)
            ends[r, offset: offset + m] = torch.tensor(trie.subtree_ends()) + offset
            offset += m
    # Key b is an ancestor of query a (or a itself) iff a lies in b's subtree range [b, end_b).
    cols_w = torch.arange(width)
    allowed = (cols_w.view(1, 1, width) <= cols_w.view(1, width, 1)) & (
        cols_w.view(1, width, 1) < ends.view(len(rows), 1, width))
    return _Layout(tokens, depths, allowed.unsqueeze(1), node_of)


def build_forest(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 versions: torch.Tensor) -> PrefixForest:
    """The prefix forest of a right-padded batch (see the module doc)."""
    n = input_ids.shape[0]
    lengths = attention_mask.sum(-1).tolist()
    starts = generation_starts(attention_mask, versions).tolist()
    seqs = [row[:length] for row, length in zip(input_ids.tolist(), lengths, strict=True)]
    longest = max(lengths)
    budget = max(longest, min(ROW_FACTOR * longest, ROW_CAP))

    # Units: one prompt's samples in a trie of their own.
    groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for i in range(n):
        groups.setdefault((tuple(seqs[i][: starts[i]]), starts[i]), []).append(i)
    layout = _layout(_units(list(groups.values()), seqs, budget), budget)

    # Every generated token (columns from the sample's start on; column 0 has no parent and
    # stays 0, as in sequence_logprobs) is its node's; each node's logprob is computed once.
    index: dict[int, int] = {}
    parents, targets, pick, sample_rows, sample_cols = [], [], [], [], []
    for i in range(n):
        base, nodes = layout.node_of[i]
        for j in range(max(starts[i], 1), lengths[i]):
            flat = base + nodes[j]
            k = index.get(flat)
            if k is None:
                k = index[flat] = len(parents)
                parents.append(base + nodes[j - 1])
                targets.append(seqs[i][j])
            pick.append(k)
            sample_rows.append(i)
            sample_cols.append(j)
    return PrefixForest(layout.tokens, layout.depths, layout.allowed,
                        torch.tensor(parents, dtype=torch.long),
                        torch.tensor(targets, dtype=torch.long), torch.tensor(pick, dtype=torch.long),
                        torch.tensor(sample_rows, dtype=torch.long),
                        torch.tensor(sample_cols, dtype=torch.long))


@dataclass
class PrefillForest:
    """A prefill of several sequences on a prefix forest, and where each one's columns are."""

    input_ids: torch.Tensor  # [R, W] node tokens
    position_ids: torch.Tensor  # [R, W] node depths
    allowed: torch.Tensor  # [R, 1, W, W] bool
    nodes: torch.Tensor  # [U, P] flat node (r * W + w) of each sequence's column, left-padded
    mask: torch.Tensor  # [U, P] 1 on real columns
    last: torch.Tensor  # [U] flat node of each sequence's last token (its logits sample next)


def prefill_forest(seqs: list[list[int]], row_budget: int) -> PrefillForest:
    """The forest of sequences joining a decode batch (the embedded engine's prefill): every
    distinct prefix once, rows of at most ``row_budget`` nodes (or the longest sequence). A
    sequence's keys and values are its nodes', gathered in column order."""
    longest = max(len(q) for q in seqs)
    budget = max(longest, row_budget)
    layout = _layout(_units([list(range(len(seqs)))], seqs, budget), budget)
    nodes = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, q in enumerate(seqs):
        base, path = layout.node_of[i]
        flat = torch.tensor(path) + base
        nodes[i, longest - len(q):] = flat
        nodes[i, : longest - len(q)] = flat[0]  # padding copies a real node (finite values)
        mask[i, longest - len(q):] = 1
    return PrefillForest(layout.tokens, layout.depths, layout.allowed, nodes, mask, nodes[:, -1])


def shares_prefixes(config: object) -> bool:
    """Whether the prefix forest can run this model (a prepared mask expresses its attention);
    the reason is logged once when it cannot, and the rows then run whole."""
    impl = getattr(config, "_attn_implementation", "sdpa")
    reason = None
    if impl not in MASKED_ATTENTION:
        reason = f"attention {impl!r} takes no prepared mask"
    else:
        try:
            layer_masks(config, torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, 1, 1))
        except UnsupportedAttention as exc:
            reason = str(exc)
    if reason is not None and reason not in _LOGGED:
        _LOGGED.add(reason)
        log.warning("shared prefixes off for this model: %s; every row runs whole", reason)
    return reason is None


_LOGGED: set[str] = set()


def prefix_tree_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor, versions: torch.Tensor,
                         temperature: float,
                         chunk_tokens: int | None = LOGIT_CHUNK_TOKENS) -> torch.Tensor:
    """:func:`sequence_logprobs` at the generated tokens, each distinct prefix computed once.
    Columns before a row's first generated token are 0 (the loss never reads them). Models whose
    attention takes no prepared mask (flash-attention kernels) run the rows whole.
    ``chunk_tokens``: as in :func:`sequence_logprobs`."""
    config = getattr(model, "module", model).config  # a DeepSpeed engine wraps the model
    if not shares_prefixes(config):
        return sequence_logprobs(model, input_ids, attention_mask, temperature, chunk_tokens)
    n, width = input_ids.shape
    device = input_ids.device
    forest = build_forest(input_ids.cpu(), attention_mask.cpu(), versions.cpu())
    depths = forest.position_ids.to(device)
    masks = layer_masks(config, forest.allowed.to(device),
                        depths.view(len(depths), 1, -1, 1) - depths.view(len(depths), 1, 1, -1))
    if config._attn_implementation == "eager":  # eager attention adds the mask to its scores
        dtype = next(model.parameters()).dtype

        def additive(m: torch.Tensor) -> torch.Tensor:
            return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(
                ~m, torch.finfo(dtype).min)

        masks = ({k: additive(m) for k, m in masks.items()} if isinstance(masks, dict)
                 else additive(masks))
    inputs = {"input_ids": forest.input_ids.to(device), "position_ids": depths,
              "attention_mask": masks, "use_cache": False}
    parents, targets = forest.parents.to(device), forest.targets.to(device)
    head = output_head(model) if chunk_tokens else None
    if head is None:
        logits = model(**inputs).logits
        picked = logits.reshape(-1, logits.shape[-1]).index_select(0, parents)
        node_logp = torch.log_softmax(picked.float() / temperature, dim=-1).gather(
            -1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        with _without_head(model, head):
            hidden = model(**inputs).logits
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, parents)
        node_logp = chunked_logprobs(head, picked, targets, temperature, chunk_tokens)
    out = torch.zeros(n, width, dtype=node_logp.dtype, device=device)
    return out.index_put((forest.rows.to(device), forest.cols.to(device)),
                         node_logp[forest.pick.to(device)])
