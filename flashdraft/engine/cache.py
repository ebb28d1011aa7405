"""The target's K/V cache in preallocated tensors, where rolling back a rejected block is a length."""

from __future__ import annotations

import torch


def _leading(padding: torch.Tensor) -> torch.Tensor | None:
    """[b, n] bool padding -> int64 [b] how many positions each row's padding takes, where all of it leads the
    row (left padding); None where some row has padding after a token."""
    counts = padding.sum(dim=1)
    return counts if torch.equal(padding, torch.arange(padding.shape[1])[None] < counts[:, None]) else None


class EngineCache:
    """The target's K/V for every layer in preallocated tensors: rows [b, kv_heads, capacity, head_dim] per layer,
    filled up to `length`. Rolling back is lowering the length; capacity doubles when a forward needs more.
    `padding` ([b, capacity] bool, True where a left-padded row has no token) exists only for padded batches."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, by_position: bool = False):
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype = dtype
        self.keys: torch.Tensor | None = None  # [layers, b, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None
        self.leading_padding: torch.Tensor | None = None  # int64 [b]: each row's padding, where it all leads
        self.length = 0
        # By position (sequences of different lengths decoded together, `flashdraft.batching`): each row keeps a
        # token's K/V at the token's own position and a query sees the positions up to its own, so rows need no
        # padding and a row's rollback is nothing at all (what lies past its position is never seen, then
        # overwritten). The first `rows` of the allocated rows are in use; `length` is the furthest position written.
        self.by_position = by_position
        self.rows = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    def reserve(self, batch: int, length: int) -> None:
        """Room for `length` positions of `batch` rows (keeping what is cached)."""
        allocated = 0 if self.keys is None else self.keys.shape[1]
        if self.by_position:
            if batch != self.rows:
                raise ValueError(f"this cache holds {self.rows} rows, the forward has {batch}")
            batch = max(batch, allocated)
        elif self.keys is not None and allocated != batch:
            raise ValueError(f"this cache holds {allocated} rows, the forward has {batch}")
        if length <= self.capacity and batch <= allocated:
            return
        capacity = max(256, self.capacity)
        while capacity < length:
            capacity *= 2
        layers, kv_heads, head_dim = self.shape
        keys = torch.zeros(layers, batch, kv_heads, capacity, head_dim, dtype=self.dtype)
        values = torch.zeros_like(keys)
        if self.keys is not None:
            keys[:, :allocated, :, : self.length] = self.keys[:, :, :, : self.length]
            values[:, :allocated, :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values = keys, values
        if self.padding is not None:
            self.padding = torch.cat([self.padding, self.padding.new_zeros(batch, capacity - self.padding.shape[1])], 1)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a negative `length` drops that many from the end)."""
        self.length = length if length >= 0 else max(self.length + length, 0)

    def get_seq_length(self) -> int:
        return self.length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (finished sequences leave a batch)."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        if self.padding is not None:
            self.padding = self.padding[rows]
        if self.leading_padding is not None:
            self.leading_padding = self.leading_padding[rows].contiguous()

    def row_kv(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s K/V at positions 0..length-1: two [layers, kv_heads, length, head_dim] views."""
        return self.keys[:, row, :, :length], self.values[:, row, :, :length]

    def add_row(self, kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """By position: a row joins as the last, holding `kv` at positions 0..n-1 (two [layers, kv_heads, n,
        head_dim] tensors, e.g. another cache's `row_kv`), or empty for None (what its slot holds lies past its
        length: never seen, then overwritten). Allocated rows double when full, so joining copies one row, not the
        batch."""
        length = 0 if kv is None else kv[0].shape[2]
        allocated = 0 if self.keys is None else self.keys.shape[1]
        if self.rows == allocated:
            self._grow_rows(max(2 * allocated, 1))
        self.rows += 1
        self.reserve(self.rows, max(self.length, length))
        if kv is not None:
            self.keys[:, self.rows - 1, :, :length] = kv[0]
            self.values[:, self.rows - 1, :, :length] = kv[1]
        self.length = max(self.length, length)

    def remove_row(self, row: int) -> None:
        """By position: row `row` leaves; the last row moves into its place."""
        last = self.rows - 1
        if row != last:
            self.keys[:, row, :, : self.length] = self.keys[:, last, :, : self.length]
            self.values[:, row, :, : self.length] = self.values[:, last, :, : self.length]
        self.rows = last

    def _grow_rows(self, allocated: int) -> None:
        layers, kv_heads, head_dim = self.shape
        keys = torch.zeros(layers, allocated, kv_heads, max(self.capacity, 256), head_dim, dtype=self.dtype)
        values = torch.zeros_like(keys)
        if self.keys is not None:
            keys[:, : self.keys.shape[1], :, : self.length] = self.keys[:, :, :, : self.length]
            values[:, : self.keys.shape[1], :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values = keys, values

