"""The embedded engine's KV cache: the running batch's keys and values in preallocated buffers.

transformers' ``DynamicCache`` grows by concatenation: every decode step copies every row's whole
cache (``torch.cat`` per layer), a joining group is copied twice (its prompt's cache to each
row, then the merge with the running batch) and a finished row copies the whole batch again
(index selection). For a small model those copies cost more than the matmuls: in a cProfile
of the engine on the demo task, cat + index_select took 0.32 s against 0.25 s of
``linear``. Here a decode step writes one column in place; a joining row is written once into
its slot; a finished row's slot is refilled by moving the last row into it.

Layout: ``keys[layer, row, head, column, dim]`` (stored in blocks of KEY_BLOCK columns for
cpu_kernels, see :class:`BlockedKeys`). Rows
``[0, size)`` are the running batch. All rows share the column window ``[lo, hi)``, left-padded
(``valid`` marks real tokens); a decode step writes column ``hi``. Columns left of ``lo`` are
headroom for a joining sequence longer than the window.

Attention: the model's attention runs through :func:`attention` (registered with transformers
as ``ATTENTION``). Decoding (one query per row) is two batched matmuls over the window; the CPU
SDPA kernel handled those shapes one (row, head) at a time, ~40% of a decode step at batch 128.
More than one query (a prefill) goes to SDPA. Masks are prepared 4D booleans (``True``: attend),
which transformers passes through as they are.

Prefill: ``prefill.forest_prefill`` computes a joining group's keys and values, which
:meth:`SlotCache.join` takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION = "oolong_slots"
LEFT_HEADROOM = 32  # columns kept free left of a new window, for longer joiners
FULL_WIDTH_STEP = 32  # columns a full-width buffer grows by, at least (see SlotCache._room)
KEY_BLOCK = 32  # columns per block of keys in cpu_kernels' layout (kernels/decode_step.cpp BLOCK)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """query [B, H, q, D], key/value [B, Hkv, L, D], mask [B, 1, q, L] bool -> [B, q, H, D]."""
    b, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    if q == 1 and dropout == 0.0:
        group = heads // kv_heads  # grouped-query attention: query heads per key head
        scores = torch.matmul(query.reshape(b, kv_heads, group, dim), key.transpose(-1, -2))
        scores = scores * scale
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask.view(b, 1, 1, -1), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), value)  # [B, Hkv, group, D]
        return out.reshape(b, 1, heads, dim), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scale,
                                         enable_gqa=kv_heads != heads)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, attention)


class SlotCache:
    """What a transformers forward needs of a cache (``update``), plus the engine's moves."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, *, full_width: bool | None = None,
                 keys_blocked: bool = False):
        self.shape = (layers, kv_heads, head_dim)
        # Keys in blocks of KEY_BLOCK columns for cpu_kernels' attention (BlockedKeys): a block's
        # columns of one dimension are contiguous, which is what its q . K^T reads, and a row's
        # attended blocks are one run of memory. Torch's path writes the step's key as a column
        # of that layout (a scattered copy), so it keeps keys as they are. The kernel reads a
        # row's attended columns only, so its buffers are always full width.
        self.keys_blocked = keys_blocked
        if keys_blocked and full_width is False:
            raise ValueError("keys_blocked (cpu_kernels' attention) decodes over full-width buffers")
        # Decode attends over the buffers' whole width, masked, instead of the window: CPU's
        # reduced-precision batched matmul copies an operand whose matrices are not packed one
        # after another (a window of a wider buffer is not), and that copy cost more than the
        # masked columns do (SmolLM2 in bf16, 64 rows, window 200 of 320 columns: q.K^T 613 us
        # with the copy, 190 us packed). fp32's takes the window as it is. Buffers are then
        # zero-filled (every column is read) and grow by what is needed, not doubled.
        self.full_width = keys_blocked or (device.type == "cpu"
                                           and dtype in (torch.bfloat16, torch.float16)
                                           if full_width is None else full_width)
        self.dtype, self.device = dtype, device
        self.keys: torch.Tensor | BlockedKeys = torch.zeros(0)
        self.values = torch.zeros(0)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.size = 0
        self.lo = self.hi = 0
        self._allocate(rows=16, cols=128)

    # ---- transformers' side --------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *_: object, **__: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys/values at column ``hi`` (``advance`` moves it afterwards) and
        return the window up to them. What else the model passes is ignored: its name changed
        between transformers releases (``cache_kwargs`` up to 5.23, ``kwargs`` in 5.24)."""
        assert not self.keys_blocked, "blocked keys are written by cpu_kernels' attention"
        n, q = key_states.shape[0], key_states.shape[2]
        self.keys[layer_idx, :n, :, self.hi: self.hi + q] = key_states
        self.values[layer_idx, :n, :, self.hi: self.hi + q] = value_states
        if self.full_width:
            return self.keys[layer_idx, :n], self.values[layer_idx, :n]
        return (self.keys[layer_idx, :n, :, self.lo: self.hi + q],
                self.values[layer_idx, :n, :, self.lo: self.hi + q])

    def decode_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a kernel that writes the step's key and value itself (cpu_kernels): the layer's
        key blocks [size, Hkv, L / KEY_BLOCK, D, KEY_BLOCK] and values [size, Hkv, L, D] over the
        decode mask's columns (the buffers' whole width), and the column the step writes."""
        assert isinstance(self.keys, BlockedKeys), "a kernel's buffers: SlotCache(..., keys_blocked=True)"
        n = self.size
        return self.keys.blocks[layer_idx, :n], self.values[layer_idx, :n], self.hi

    def decode_stacks(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every layer's :meth:`decode_buffers` at once: key blocks [layers, size, Hkv, L /
        KEY_BLOCK, D, KEY_BLOCK], values [layers, size, Hkv, L, D] and the column (for
        cpu_kernels' decode_layers, which selects the layer itself)."""
        assert isinstance(self.keys, BlockedKeys), "a kernel's buffers: SlotCache(..., keys_blocked=True)"
        n = self.size
        return self.keys.blocks[:, :n], self.values[:, :n], self.hi

    # ---- the engine's side ---------------------------------------------------------------------

    def decode_mask(self) -> torch.Tensor:
        """The mask for one new token per row (written at column ``hi``): [size, 1, 1, L]."""
        self._room(left=0, right=1)
        self.valid[: self.size, self.hi] = True
        if self.full_width:
            return self.valid[: self.size].view(self.size, 1, 1, -1)
        return self.valid[: self.size, self.lo: self.hi + 1].view(self.size, 1, 1, -1)

    def decode_distance(self) -> torch.Tensor:
        """Query position minus key position over the decode mask's columns, [1, 1, 1, L]: a
        row's tokens are contiguous and end at column ``hi``, so a column's distance from the new
        token is the same for every row (what a sliding window needs)."""
        cols = (torch.arange(self.valid.shape[1], device=self.device) if self.full_width
                else torch.arange(self.lo, self.hi + 1, device=self.device))
        return (self.hi - cols).view(1, 1, 1, -1)

    def advance(self) -> None:
        self.hi += 1

    def join(self, layers_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             owner: torch.Tensor) -> None:
        """Append rows: their prefill cache (per layer [U, Hkv, P, D], left-padded, ``mask``
        [U, P]) and which prefilled sequence each new row copies (``owner``)."""
        k, width = len(owner), mask.shape[1]
        if self.size == 0:
            self.lo = self.hi = (0 if self.full_width else LEFT_HEADROOM) + width
        self._room(left=width, right=1, rows=self.size + k)
        rows = slice(self.size, self.size + k)
        start = self.hi - width
        # Columns entering the window are zeroed before anything reads them (the buffers are
        # uninitialised, see _allocate): masked keys only need to be finite, masked values must
        # be finite too (their weight is 0, and 0 * nan is nan).
        if start < self.lo:  # the window grows left, over the running rows
            self.keys[:, : self.size, :, start: self.lo] = 0
            self.values[:, : self.size, :, start: self.lo] = 0
        elif start > self.lo:  # the joiners are shorter than the window
            self.keys[:, rows, :, self.lo: start] = 0
            self.values[:, rows, :, self.lo: start] = 0
        for layer, (keys, values) in enumerate(layers_kv):
            self.keys[layer, rows, :, start: self.hi] = keys.index_select(0, owner)
            self.values[layer, rows, :, start: self.hi] = values.index_select(0, owner)
        self.valid[rows] = False
        self.valid[rows, start: self.hi] = mask.index_select(0, owner).bool()
        self.lo = min(self.lo, start)
        self.size += k

    def keep(self, rows: list[int]) -> list[int]:
        """Keep ``rows`` (sorted) and drop the others: each hole below the new size is filled by a
        kept row from above it. Returns the new order (old row index per new row)."""
        new_size = len(rows)
        kept = set(rows)
        holes = [i for i in range(new_size) if i not in kept]
        movers = [j for j in rows if j >= new_size]
        order = list(range(new_size))
        window = slice(self.lo, self.hi)
        # One slice copy per moved row: half the time of one advanced-indexing copy for them all
        # (a few rows move at a time).
        for h, m in zip(holes, movers, strict=True):
            if isinstance(self.keys, BlockedKeys):  # whole blocks: columns outside are unused
                b0, b1 = self.lo // KEY_BLOCK, -(-self.hi // KEY_BLOCK)
                self.keys.blocks[:, h, :, b0:b1] = self.keys.blocks[:, m, :, b0:b1]
            else:
                self.keys[:, h, :, window] = self.keys[:, m, :, window]
            self.values[:, h, :, window] = self.values[:, m, :, window]
            self.valid[h] = self.valid[m]
            order[h] = m
        self.size = new_size
        if new_size:  # trim the left padding every row has
            used = self.valid[:new_size, self.lo: self.hi].any(0)
            self.lo += int(used.long().argmax()) if bool(used.any()) else self.hi - self.lo
        return order

    def clear(self) -> None:
        self.size = 0


    # ---- buffers -------------------------------------------------------------------------------

    def _allocate(self, rows: int, cols: int) -> None:
        # Uninitialised: only the window is ever used (the kernel also reads the masked columns
        # of the key blocks holding it, scored by their bias), and every column is written before it
        # enters the window (join, decode) or moves with it (_room, keep). Zero-filled buffers
        # cost a page fault and a write per 4 KiB of capacity, most of it never used: a growth
        # to 256 rows x 256 columns (2 x 134 MB, the long-tail benchmark's size) stalled the
        # engine 107 ms, 18 ms uninitialised.
        layers, heads, dim = self.shape
        # torch's full-width attention reads every column (0 * nan is nan); cpu_kernels' reads
        # the key blocks holding attended columns and the attended values only, and leaves
        # masked ones out whatever they hold
        make = torch.zeros if self.full_width and not self.keys_blocked else _uninitialized
        shape = (layers, rows, heads, cols, dim)
        self.values = make(shape, dtype=self.dtype, device=self.device)
        if self.keys_blocked:  # full width grows by FULL_WIDTH_STEP, a multiple of KEY_BLOCK
            assert cols % KEY_BLOCK == 0, cols
            self.keys = BlockedKeys(make((layers, rows, heads, cols // KEY_BLOCK, dim, KEY_BLOCK),
                                         dtype=self.dtype, device=self.device))
        else:
            self.keys = make(shape, dtype=self.dtype, device=self.device)
        self.valid = torch.zeros(rows, cols, dtype=torch.bool, device=self.device)

    def _room(self, *, left: int, right: int, rows: int = 0) -> None:
        """Make sure ``left`` columns fit before ``hi``, ``right`` from ``hi`` on, and ``rows``
        rows: move the window (and grow the buffers) when they do not."""
        cap_rows, cap_cols = self.valid.shape
        span = self.hi - self.lo
        fits = rows <= cap_rows and left <= self.hi and self.hi + right <= cap_cols
        if self.full_width:
            # Columns the window left behind (its rows finished) are dropped at a reallocation.
            new_lo = max(0, left - span)
            need_cols = new_lo + span + right
            if self.keys_blocked:
                # cpu_kernels' attention reads the key blocks holding a row's attended columns
                # and its attended values only (and fetches ahead no further), so room past the
                # window costs nothing: the buffers grow by
                # half what is needed and are kept for the next batch. Every reallocation pages in
                # and copies the cache (SmolLM2 bf16 at 64 rows, ~160 columns: 176 ms each in the
                # engine); growing by FULL_WIDTH_STEP, below, did that five times in a 128-token
                # request.
                if fits and cap_cols <= 8 * need_cols + 2 * FULL_WIDTH_STEP:
                    return  # a batch far narrower than the buffers gives the memory back
                # the window keeps its offset within a block, so its key blocks move whole
                new_lo += (self.lo - new_lo) % KEY_BLOCK
                need_cols = new_lo + span + right
                step = FULL_WIDTH_STEP
                need_cols += max(FULL_WIDTH_STEP, need_cols // 2)
            else:
                # Every column costs torch's attention at every step, so the buffers hold the
                # window and a few steps more: a reallocation copies the cache once per
                # FULL_WIDTH_STEP columns (SmolLM2, 64 rows, 200 columns: 295 MB, ~15 ms every 32
                # steps), where a wider buffer cost more at every step (q.K^T at 64 rows over 320
                # columns 298 us, over 128 88 us).
                step = max(FULL_WIDTH_STEP, need_cols // 8)
                if fits and cap_cols - need_cols < 2 * step:
                    return
            grow, cols = True, -(-need_cols // step) * step
        else:
            if fits:
                return
            new_lo = max(LEFT_HEADROOM, left - span + LEFT_HEADROOM)
            need_cols = new_lo + span + max(right, 64)
            grow = rows > cap_rows or need_cols > cap_cols
            cols = max(need_cols, cap_cols * 2 if need_cols > cap_cols else cap_cols)
        keys, values, valid = self.keys, self.values, self.valid
        if grow:
            self._allocate(max(rows, cap_rows * (2 if rows > cap_rows else 1)), cols)
        else:  # same buffers: copy the window out first (source and target may overlap)
            keys = keys[:, : self.size, :, self.lo: self.hi].clone()
            values = values[:, : self.size, :, self.lo: self.hi].clone()
            valid = valid[: self.size, self.lo: self.hi].clone()
            self.valid.zero_()
            self.lo, self.hi = 0, span
        n = self.size
        if isinstance(keys, BlockedKeys) and isinstance(self.keys, BlockedKeys):
            self.keys.move(keys, n, self.lo, self.hi, new_lo)
        else:
            self.keys[:, :n, :, new_lo: new_lo + span] = keys[:, :n, :, self.lo: self.hi]
        self.values[:, :n, :, new_lo: new_lo + span] = values[:, :n, :, self.lo: self.hi]
        self.valid[:n] = False
        self.valid[:n, new_lo: new_lo + span] = valid[:n, self.lo: self.hi]
        self.lo, self.hi = new_lo, new_lo + span


class BlockedKeys:
    """Keys stored [layer, row, head, column block, dim, KEY_BLOCK] for cpu_kernels' attention,
    indexed as the other layout is, ``keys[layer, rows, heads, columns]`` -> [..., columns, dim]
    (a copy when read: an advanced index), so the slot cache's moves work on both. The columns
    must be a slice with step 1."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks
        self._by_column = blocks.permute(0, 1, 2, 3, 5, 4)  # [..., block, column in it, dim]

    def _index(self, index: tuple) -> tuple:
        *lead, cols = index
        start, stop, step = cols.indices(self.blocks.shape[3] * KEY_BLOCK)
        assert step == 1 and len(lead) == 3, index
        c = torch.arange(start, stop, device=self.blocks.device)
        return (*lead, c // KEY_BLOCK, c % KEY_BLOCK)

    def __getitem__(self, index: tuple) -> torch.Tensor:
        return self._by_column[self._index(index)]

    def __setitem__(self, index: tuple, value: torch.Tensor | float) -> None:
        self._by_column[self._index(index)] = value

    def move(self, old: BlockedKeys, rows: int, lo: int, hi: int, new_lo: int) -> None:
        """Columns [lo, hi) of ``old``'s first ``rows`` rows to [new_lo, ...) here, as whole
        blocks: SlotCache._room keeps the window's offset within a block."""
        if rows == 0 or hi <= lo:  # nothing to move (a first join sets lo = hi past the buffer)
            return
        assert (new_lo - lo) % KEY_BLOCK == 0, (lo, new_lo)
        b0, b1, to = lo // KEY_BLOCK, -(-hi // KEY_BLOCK), new_lo // KEY_BLOCK
        assert to + b1 - b0 <= self.blocks.shape[3], (lo, hi, new_lo, self.blocks.shape)
        self.blocks[:, :rows, :, to: to + b1 - b0] = old.blocks[:, :rows, :, b0:b1]


def _uninitialized(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
