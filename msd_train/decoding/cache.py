"""A KV cache of fixed capacity, written by position: the decoder's caches (target and head).

Why not transformers' ``StaticCache``: its layers write at a running device counter
(``cumulative_length``) that every forward advances, and report that counter as their
length. A speculative cycle needs three things it does not offer: (1) write the N tree
nodes at ``[m, m + N)`` and then rewind to ``m + accepted``, (2) move the accepted
path's entries into place with one gather/``index_copy_`` over all layers, (3) a length
the host knows without reading the device (the draft head asks for the cache length on
every forward; a device counter read there is one sync per head step). This cache is
that, in a few lines: per layer one preallocated ``(B, heads, capacity, dim)`` buffer
pair; a forward writes its T entries at the positions it is given, ``cache.at(index)``
(a device tensor the decoder fills, a static buffer when the forward is replayed from a
captured graph: gpt-fast's ``input_pos``), and attends over the first ``width`` slots
of the buffer (``cache.at(index, width)``), so queries see only what their 4-D additive
mask allows (the decoder always passes one, ``width`` columns wide; unwritten slots, and
whatever an earlier prompt left in reused buffers, are masked). A captured forward attends
over the whole capacity (its shapes are fixed); an eager one over the slots written so far
only (``attention_width``): on a CPU, attending over a 2k-slot buffer to read 300 entries
cost the plain loop 4% of each step against transformers' ``generate()``. ``length`` is
the committed length, kept on the host.

It subclasses transformers' ``Cache`` so that models treat it like their own: attention
layers call ``update(keys, values, layer_idx)``; mask builders see a 4-D mask and
return it as is.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache


class _Buffers:
    """One layer's key and value buffers (the attributes transformers' helpers read)."""

    is_sliding = False
    is_compileable = True
    is_initialized = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class PositionCache(Cache):
    def __init__(self, layers: list[_Buffers], length: int, capacity: int):
        super().__init__(layers=layers)
        self._capacity = capacity
        self.length = length  # committed entries [0, length); host-side, never read from the device
        self._index: torch.Tensor | None = None  # (T,) where a forward writes: set only on ``at``'s views
        self._width: int | None = None  # the slots a forward attends over (``at``'s views; None: all)

    # ----- construction ---------------------------------------------------------------

    @classmethod
    def from_cache(cls, cache, capacity: int) -> PositionCache:
        """Copy a filled cache (e.g. the ``DynamicCache`` of a prefill) into buffers of
        ``capacity`` positions."""
        layers = []
        for layer in cache.layers:
            b, h, n, d = layer.keys.shape
            if n > capacity:
                raise ValueError(f"cache of {n} positions does not fit a capacity of {capacity}")
            keys = layer.keys.new_zeros(b, h, capacity, d)
            values = layer.values.new_zeros(b, h, capacity, layer.values.shape[-1])
            keys[:, :, :n], values[:, :, :n] = layer.keys, layer.values
            layers.append(_Buffers(keys, values))
        return cls(layers, cache.layers[0].keys.shape[-2] if cache.layers else 0, capacity)

    def load(self, cache) -> bool:
        """Copy a filled cache into these buffers (what an earlier prompt left beyond it stays,
        masked); False, and nothing copied, when it does not fit their shape."""
        if not cache.layers:
            self.length = 0
            return True
        n = cache.layers[0].keys.shape[-2]
        if len(cache.layers) != len(self.layers) or n > self.capacity:
            return False
        for mine, theirs in zip(self.layers, cache.layers):
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                if a.shape[:2] != b.shape[:2] or a.shape[-1] != b.shape[-1] or a.dtype != b.dtype:
                    return False
        for mine, theirs in zip(self.layers, cache.layers):
            mine.keys[:, :, :n] = theirs.keys
            mine.values[:, :, :n] = theirs.values
        self.length = n
        return True

    @property
    def capacity(self) -> int:
        return self._capacity

    def grow(self, capacity: int) -> bool:
        """Reallocate to at least ``capacity`` positions (doubling), keeping the contents;
        True when it did (captured graphs hold the old buffers). Rare: ``generate`` sizes
        caches for the whole generation up front."""
        if capacity <= self.capacity:
            return False
        capacity = max(capacity, 2 * self.capacity)
        self._capacity = capacity
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : old.shape[2]] = old
                setattr(layer, name, new)
        return True

    def clone(self) -> PositionCache:
        out = copy.copy(self)
        out.layers = [_Buffers(layer.keys.clone(), layer.values.clone()) for layer in self.layers]
        return out

    def at(self, index: torch.Tensor, width: int | None = None) -> PositionCache:
        """This cache as one forward sees it: its T new entries are written at ``index`` (T,),
        attention reads slots ``[0, width)`` (None: the whole capacity), the same buffers;
        the view lives for that forward only."""
        view = copy.copy(self)  # shares the layer list and buffers
        view._index, view._width = index, width
        return view

    # ----- the Cache interface models call --------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._index is None:
            raise RuntimeError("PositionCache is written by position: pass cache.at(index) to the forward")
        while len(self.layers) <= layer_idx:  # a cache that started empty (a one-token prompt's head)
            b, h, _, d = key_states.shape
            self.layers.append(_Buffers(key_states.new_zeros(b, h, self.capacity, d),
                                        value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])))
        layer = self.layers[layer_idx]
        layer.keys.index_copy_(2, self._index, key_states.to(layer.keys.dtype))
        layer.values.index_copy_(2, self._index, value_states.to(layer.values.dtype))
        if self._width is not None and self._width < self.capacity:
            return layer.keys[:, :, : self._width], layer.values[:, :, : self._width]
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self) -> int:
        return self.capacity

    # ----- the decoder's operations ---------------------------------------------------

    def keep(self, start: int, index: torch.Tensor) -> None:
        """Entries ``start + index`` (device tensor, in order) move to ``start, start+1,
        ...``: one gather and one ``index_copy_`` per buffer, shapes fixed by ``index``.
        The caller sets ``length``."""
        dest = torch.arange(start, start + index.shape[0], device=index.device)
        src = index + start
        for layer in self.layers:
            layer.keys.index_copy_(2, dest, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dest, layer.values.index_select(2, src))

    def committed(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys and values of one layer (views), e.g. to compare with a prefill."""
        layer = self.layers[layer_idx]
        return layer.keys[:, :, : self.length], layer.values[:, :, : self.length]


def attention_width(captured: bool, capacity: int, end: int) -> int:
    """The key slots a forward that writes up to slot ``end`` attends over: the whole
    ``capacity`` when it is (or will be) replayed from a captured graph, which fixes its
    shapes; else only ``[0, end)``."""
    return capacity if captured else min(end, capacity)


def key_mask(past: int, capacity: int, queries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, N, capacity) for N queries written at ``[past, past + A)``:
    every query sees the committed prefix ``[0, past)`` and, of the A newest slots, those
    ``queries`` (N, A) bool allows; nothing beyond ``past + A``."""
    n, a = queries.shape
    allowed = torch.zeros(n, capacity, dtype=torch.bool, device=queries.device)
    allowed[:, :past] = True
    allowed[:, past : past + a] = queries
    bias = torch.zeros(n, capacity, dtype=dtype, device=queries.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
