"""The static runtime's K/V cache: preallocated rows and columns, written at a column per query token per row.

Each layer holds K/V of shape `(R, kv_heads, L, head_dim)`: `R` rows (the batch capacity) and `L` columns,
allocated once on the layer's own device (a `device_map` model keeps each layer where it is), outside
`torch.inference_mode` (a cache made during an `inference_mode` call stays writable by later `no_grad` or plain
calls). Before each forward the runner says where every query token of every row goes (`(m, W)` write columns)
and how many leading columns the forward attends over (the prefix `P <= L`): each layer scatters its K/V there,
in place, and returns the first `m` rows and `P` columns. What is visible is the runner's mask's business.

Source: transformers `StaticLayer` / `Cache` (5.17-5.24), whose whole-batch running write position does not fit
rows that store different amounts; issue 32 (attention over a bucketed prefix, not the allocated length).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer


class CacheWrites:
    """What every layer of one :class:`RowStaticCache` reads at a forward: the write columns, the attended prefix and
    the rows to allocate. The cache and its layers share it; the layers hold no reference to their cache, so a cache
    and its buffers are freed as soon as it is dropped (a layer -> cache -> layer cycle would keep the device memory
    until Python's cyclic collector runs).

    Args:
        rows (`int`): rows to allocate, R (at least the first forward's).
        prefix (`int`): the columns a forward attends over, P.
    """

    def __init__(self, rows: int, prefix: int) -> None:
        self.rows, self.prefix = rows, prefix
        self.columns: torch.Tensor | None = None
        self.on_device: dict[torch.device, torch.Tensor] = {}

    def write_columns(self, device: torch.device) -> torch.Tensor:
        """The write columns `(m, W)` int64 on `device` (copied there once per forward)."""
        if device not in self.on_device:
            self.on_device[device] = self.columns.to(device)
        return self.on_device[device]


class RowStaticLayer(StaticLayer):
    """A transformers `StaticLayer` that writes each row at its own columns and returns a prefix of its columns.

    transformers' `StaticLayer.update` writes the whole batch at one running position (`cumulative_length`, which
    every update advances, read-only tokens included). Here the cache's :class:`CacheWrites` gives the column of
    every query token of every row and the prefix to return.
    """

    def __init__(self, max_cache_len: int, writes: CacheWrites) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.writes = writes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter `key_states` / `value_states` `(m, kv_heads, W, head_dim)` at the owner's write columns of the
        first m rows; return the first m rows and the owner's prefix of columns, `(m, kv_heads, P, head_dim)`."""
        self.allocate(key_states, value_states)
        m = key_states.shape[0]
        columns = self.writes.write_columns(self.device)[:, None, :, None]          # (m, 1, W, 1)
        keys, values = self.keys[:m], self.values[:m]
        keys.scatter_(2, columns.expand(-1, keys.shape[1], -1, keys.shape[-1]), key_states)
        values.scatter_(2, columns.expand(-1, values.shape[1], -1, values.shape[-1]), value_states)
        prefix = self.writes.prefix
        return keys[:, :, :prefix], values[:, :, :prefix]

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, rows: int = 0) -> None:
        """Allocate the buffers on the first write, `(R, kv_heads, L, head_dim)` with R the owner's rows, at least
        `key_states`' and `rows` (the keys' dtype and device; the values' dtype), outside `inference_mode`; no-op
        afterwards."""
        if self.is_initialized:
            return
        rows = max(self.writes.rows, key_states.shape[0], rows)
        with torch.inference_mode(False):
            self.lazy_initialization(key_states[:1].expand(rows, -1, -1, -1), value_states[:1].expand(rows, -1, -1, -1))
            if self.values.dtype != value_states.dtype:
                # transformers 5.17 gives both buffers the keys' dtype (5.24 each its own); under `torch.autocast`
                # the keys can come out of the rotary embedding in float32 while the values are 16-bit, as in eager
                self.values = self.values.to(value_states.dtype)
                if not torch.compiler.is_compiling():
                    torch._dynamo.mark_static_address(self.values)

    def get_seq_length(self) -> int:
        """0: the stored length is per row and lives in the runner (`StaticModelRunner.lengths`); transformers only
        reads it to build a mask or positions, both of which the runner passes explicitly."""
        return 0


class RowStaticCache(Cache):
    """A static K/V cache of `rows` rows and `max_cache_len` columns per row, written at per-row columns
    (:class:`RowStaticLayer`).

    Args:
        num_layers (`int`): decoder layers of the model.
        max_cache_len (`int`): columns per row, L.
        rows (`int`, defaults to 1): rows to allocate, R (at least the first forward's).

    The runner sets the write columns and the attended prefix before each forward (:meth:`set_write_columns`);
    each layer reads the columns on its own device.
    """

    def __init__(self, num_layers: int, max_cache_len: int, rows: int = 1) -> None:
        self.writes = CacheWrites(rows, max_cache_len)
        super().__init__(layers=[RowStaticLayer(max_cache_len, self.writes) for _ in range(num_layers)])
        self._max_len = max_cache_len

    def set_write_columns(self, columns: torch.Tensor, prefix: int | None = None) -> None:
        """`columns` `(m, W)` int64: the cache column of each query token of each of the first m rows, all below
        `prefix` (the columns the forward attends over; all of them when None)."""
        self.writes.columns, self.writes.on_device = columns, {columns.device: columns}
        self.writes.prefix = self._max_len if prefix is None else prefix

    @property
    def max_cache_len(self) -> int:
        """L, the columns per row (a property of transformers' `Cache` on some versions)."""
        return self._max_len

    @property
    def allocated(self) -> bool:
        """Whether every layer's buffers exist (the first storing or reading forward allocates them)."""
        return all(layer.is_initialized for layer in self.layers)

    @property
    def batch_capacity(self) -> int:
        """Rows the buffers hold (R; the allocated rows once the first forward ran)."""
        layer = self.layers[0]
        return layer.keys.shape[0] if layer.is_initialized else self.writes.rows

    def select_rows(self, index: torch.Tensor) -> None:
        """Move rows `index` `(M,)` int64 to the first M rows of every layer, in place (static addresses kept);
        nothing moves when no row stays (M = 0: the call's last rows finished)."""
        if not index.shape[0]:
            return
        for layer in self.layers:
            if layer.is_initialized:
                rows = index.to(layer.device)
                m = rows.shape[0]
                layer.keys[:m] = layer.keys[rows]
                layer.values[:m] = layer.values[rows]

    def grow_rows(self, rows: int) -> None:
        """Reallocate every layer with `rows` rows, keeping the stored ones (new addresses; continuous batching)."""
        self._reallocate(rows=rows)
        self.writes.rows = max(self.writes.rows, rows)

    def grow(self, max_cache_len: int) -> None:
        """Reallocate every layer with `max_cache_len` columns, keeping the stored ones (new addresses)."""
        self._reallocate(columns=max_cache_len)
        self._max_len = max_cache_len
        self.writes.prefix = min(self.writes.prefix, max_cache_len)

    def _reallocate(self, rows: int | None = None, columns: int | None = None) -> None:
        """New buffers of `rows` rows and `columns` columns (each as before when None) for every layer, holding what
        the old ones held, marked as static addresses; allocated outside `inference_mode`."""
        with torch.inference_mode(False):
            for layer in self.layers:
                if columns is not None:
                    layer.max_cache_len = columns
                if not layer.is_initialized:
                    continue
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros(rows or old.shape[0], old.shape[1], columns or old.shape[2], old.shape[-1])
                    new[:old.shape[0], :, :old.shape[2]] = old
                    torch._dynamo.mark_static_address(new)
                    setattr(layer, name, new)


__all__ = ["CacheWrites", "RowStaticCache", "RowStaticLayer"]
