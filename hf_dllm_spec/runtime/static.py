"""The static decoding runtime: a preallocated K/V cache with a write position per row, fixed query widths, and
forwards that can be captured once and replayed (CUDA graphs).

`generate(..., cache_implementation="static")` selects it (transformers' name for its own static cache); the
default stays the eager :class:`~hf_dllm_spec.runtime.runner.ModelRunner`. :class:`StaticModelRunner` has the eager
runner's interface (`forward`, `discard_tail`, `select_rows`, `carry`, `batch_size`, the stats and timer), so every
strategy runs on it unchanged, and it gives the eager runner's tokens and forward counts.

Layout. Each layer holds K/V of shape `(N, kv_heads, L, head_dim)`, allocated once on the layer's device
(:class:`RowStaticLayer`, a transformers `StaticLayer` that writes per row). Row n has a write position
`lengths[n]`: its stored tokens are the columns `[0, lengths[n])`, in order, and nothing else. A forward of `q`
query tokens, padded to a width bucket `W >= q` (:func:`width_bucket`; the padding goes first in the query and
sees only itself), writes all `W` K/V at columns `lengths[n] + [0, W)`: first the row's real stored tokens, then the
read-only tokens, then padding; only the stored tokens advance `lengths[n]`. Read-only tokens (drafts, the
verifier's copies) are thus written past the write position and never become visible: every later query masks the
columns `>= lengths[n]` except its own. No `torch.cat`, no crop; `discard_tail` moves the write position back and
`select_rows` gathers rows into the leading rows of the same buffers.

Fixed shapes. Every forward takes input ids, positions and write columns of shape `(N, W)`, the query's own
visibility `(N, W, W)` and the write positions `(N,)`, and builds its float mask `(N, 1, W, L)` from them inside,
for a small set of `(N, W, kept logits)`: on CUDA each is captured once in a `torch.cuda.CUDAGraph` (mask included;
:class:`_CudaGraphs`, three warm-up runs on a side stream, then capture) and replayed after copying the new inputs
into its static buffers; with `compile_config` the forward goes through `model.get_compiled_call(compile_config)`
(torch.compile, transformers' meaning). Cache, buffers and graphs live on the model (:func:`_state_of`) and are
reused by later calls with the same or smaller shapes; a call that needs a longer cache reallocates it (and drops the
graphs). So one `generate` call at a time may use a model's static runtime (as with transformers' own static cache
and compiled forward); concurrent calls on one model need the eager runtime. Compilation follows transformers'
`_valid_auto_compile_criteria` (:func:`compile_plan`).

Host synchronisations. No forward of any family reads a device value on the host (so each can be captured; LLaDA2's
routed experts run transformers' "grouped_mm", also when loaded through a checkpoint's remote code), and the
decoding loop reads the device once per forward at batch 1 (the step's decisions and committed tokens in one
transfer; SimSD 1.6: its compact verify width; `hf_dllm_spec.runtime.syncs`, counted in
`tests/test_static_runtime.py`). Not yet done (GPU work): the per-step maths (sampling, commit rules, acceptance,
routing) compiled or captured with the forward (77 to 170 small tensor operations per forward outside the
model on the bundled models, each a kernel launch on a GPU: `benchmarks/host_work.py`).

Source: issue 25 (measurements on an H100 in `shared/reference/platform.md`, "Static caches, compilation and CUDA
graphs"); transformers `StaticCache` / `StaticLayer`, `CompileConfig`; PyTorch "CUDA Graphs" (whole-network capture).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache, StaticCache, StaticLayer

from model_patches.compat import find_cache, pop_cache

from ..maths.masks import to_additive
from ..outputs import BatchStats
from .placement import execution_device
from .runner import DRAFT_MODEL_SPAN, ModelRunner
from .timing import ForwardTimer
from ..validation import invalid

logger = logging.getLogger(__name__)

#: Query widths up to this are padded to the next power of two; wider ones to a multiple of it.
WIDTH_GRANULE = 256
#: Cache lengths are rounded up to a multiple of this.
LENGTH_GRANULE = 64
#: The attribute of a model that holds its static states (cache, graphs) across `generate` calls, per role.
STATE_ATTRIBUTE = "_hf_dllm_spec_static"


def width_bucket(width: int) -> int:
    """The fixed query width a forward of `width` (>= 1) tokens runs at: the next power of two up to
    :data:`WIDTH_GRANULE`, then the next multiple of it (1, 2, 4, ..., 256, 512, 768, ...)."""
    if width <= WIDTH_GRANULE:
        return 1 << max(0, width - 1).bit_length()
    return -(-width // WIDTH_GRANULE) * WIDTH_GRANULE


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


# -- the cache --------------------------------------------------------------------------------------------------
class RowStaticLayer(StaticLayer):
    """A transformers `StaticLayer` that writes each row at its own columns.

    transformers' `StaticLayer.update` writes the whole batch at one running position (`cumulative_length`, which
    every update advances, read-only tokens included). Here the owning :class:`RowStaticCache` says, per forward,
    the column of every query token of every row (`(N, W)` int64): K/V are scattered there, in place, and the
    whole `(N, kv_heads, L, head_dim)` buffers are returned (the caller's mask decides what is visible).
    Allocation stays lazy (on the first update, on the device and in the dtype of the layer's keys), so each layer
    of a `device_map` model lives on its own device.
    """

    def __init__(self, max_cache_len: int, owner: "RowStaticCache") -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter `key_states` / `value_states` `(m, kv_heads, W, head_dim)` at the owner's write columns of the
        first m rows; return the first m rows of the full buffers `(m, kv_heads, L, head_dim)`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = key_states.shape[0]
        columns = self.owner.write_columns(self.device)[:, None, :, None]           # (m, 1, W, 1)
        keys, values = self.keys[:m], self.values[:m]
        keys.scatter_(2, columns.expand(-1, keys.shape[1], -1, keys.shape[-1]), key_states)
        values.scatter_(2, columns.expand(-1, values.shape[1], -1, values.shape[-1]), value_states)
        return keys, values

    def get_seq_length(self) -> int:
        """0: the stored length is per row and lives in the runner (`StaticModelRunner.lengths`); transformers only
        reads it to build a mask or positions, both of which the runner passes explicitly."""
        return 0


class RowStaticCache(Cache):
    """A static K/V cache of `max_cache_len` columns per row, written at per-row columns (:class:`RowStaticLayer`).

    Args:
        num_layers (`int`): decoder layers of the model.
        max_cache_len (`int`): columns per row, L.

    The runner sets the write columns before each forward (:meth:`set_write_columns`); each layer reads them on its
    own device.
    """

    def __init__(self, num_layers: int, max_cache_len: int) -> None:
        super().__init__(layers=[RowStaticLayer(max_cache_len, self) for _ in range(num_layers)])
        self._max_len = max_cache_len
        self._columns: torch.Tensor | None = None
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def set_write_columns(self, columns: torch.Tensor) -> None:
        """`columns` `(m, W)` int64: the cache column of each query token of each of the first m rows."""
        self._columns, self._on_device = columns, {columns.device: columns}

    def write_columns(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = self._columns.to(device)
        return self._on_device[device]

    @property
    def max_cache_len(self) -> int:
        """L, the columns per row (a property of transformers' `Cache` on some versions)."""
        return self._max_len

    @property
    def batch_capacity(self) -> int | None:
        """Rows the buffers hold (None before the first forward)."""
        layer = self.layers[0]
        return layer.keys.shape[0] if layer.is_initialized else None

    def select_rows(self, index: torch.Tensor) -> None:
        """Move rows `index` `(M,)` int64 to the first M rows of every layer, in place (static addresses kept)."""
        for layer in self.layers:
            if layer.is_initialized:
                rows = index.to(layer.device)
                m = rows.shape[0]
                layer.keys[:m] = layer.keys[rows]
                layer.values[:m] = layer.values[rows]

    def grow(self, max_cache_len: int) -> None:
        """Reallocate every layer with `max_cache_len` columns, keeping the stored ones (new addresses)."""
        for layer in self.layers:
            layer.max_cache_len = max_cache_len
            if layer.is_initialized:
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros(*old.shape[:2], max_cache_len, old.shape[-1])
                    new[:, :, :old.shape[2]] = old
                    torch._dynamo.mark_static_address(new)
                    setattr(layer, name, new)
        self._max_len = max_cache_len


# -- compilation ------------------------------------------------------------------------------------------------
def compile_plan(model, generation_config: GenerationConfig) -> tuple[str, str]:
    """How the static runtime runs `model`'s forwards, by transformers' rule for `generate`
    (`GenerationMixin._valid_auto_compile_criteria`), and why.

    Returns:
        `(mode, reason)`: mode "eager" (forwards run as they are, over the static cache), "cuda_graph" (each
        `(batch, width)` forward captured once in a `torch.cuda.CUDAGraph`; the default on CUDA) or "compile"
        (`model.get_compiled_call(generation_config.compile_config)`, transformers' torch.compile, when a
        `compile_config` is given); `reason` is one line saying why (empty for the default).
    """
    config = generation_config.compile_config
    if generation_config.disable_compile:
        return "eager", "disable_compile=True"
    device = execution_device(model)
    all_devices = bool(config is not None and config._compile_all_devices)
    if device.type != "cuda" and not all_devices:
        return "eager", f"no compilation on {device.type} (transformers compiles on accelerators, or with " \
                        "`CompileConfig._compile_all_devices`)"
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return "eager", f"{type(quantizer).__name__} weights cannot be compiled or captured (transformers' " \
                        "`HfQuantizer.is_compileable` is False)"
    devices = {str(d) for d in getattr(model, "hf_device_map", {}).values()}
    if "cpu" in devices and len(devices) > 1 or "disk" in devices:
        return "eager", "offloaded weights (`device_map` with cpu/disk) cannot be compiled"
    if config is not None:
        return "compile", ""
    params = {p.device for p in model.parameters()}
    if len(params) > 1:
        return "eager", "CUDA graphs need the whole model on one device (pass a `compile_config` to use torch.compile)"
    return "cuda_graph", ""


class _CallProxy:
    """Stands for the model in `FamilyPatch.forward`, calling a compiled `__call__` instead."""

    def __init__(self, call) -> None:
        self._call = call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


class _CudaGraphs:
    """One captured forward per `(rows, width, kept logits)`: static inputs, the graph and its output.

    Capture (PyTorch's whole-network recipe): three warm-up runs on a side stream, then `torch.cuda.graph` with one
    memory pool shared by the model's graphs. The warm-up runs are real forwards (they write the same K/V at the
    same columns), so the first call's result is the last warm-up's.
    """

    WARMUP_RUNS = 3

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, int, int], tuple[Any, ...]] = {}
        self.pool = None
        self.captures = 0
        self.failed: str = ""            # why capture failed once (the forward syncs with the host, ...): eager since

    def run(self, key, run_forward, inputs: tuple, cache: RowStaticCache):
        """Replay (or capture, the first time) `run_forward(*inputs)` for `key`; returns a fresh copy of its logits.

        `inputs`: `(ids, pos, wide, columns, lengths)` (:meth:`StaticModelRunner._run`); they are copied into the
        graph's static buffers, and the cache's layers read the write columns from their buffer."""
        entry = self.graphs.get(key)
        if entry is None:
            buffers = [value.clone() for value in inputs]
            cache.set_write_columns(buffers[3])
            out = self._warm_up(run_forward, buffers)
            try:
                replay, static_out = self._capture(run_forward, buffers)
            except RuntimeError as error:          # e.g. a host sync inside the forward (data-dependent MoE routing)
                self.failed = f"CUDA graph capture failed ({str(error).splitlines()[0][:120]}); eager forwards"
                logger.warning("hf_dllm_spec: %s", self.failed)
                return out.clone()
            self.graphs[key] = (replay, buffers, static_out)
            self.captures += 1
            return out.clone()
        replay, buffers, static_out = entry
        cache.set_write_columns(buffers[3])
        for buffer, value in zip(buffers, inputs):
            buffer.copy_(value)
        replay()
        return static_out.clone()

    def _warm_up(self, run_forward, buffers: list[torch.Tensor]) -> torch.Tensor:
        """:data:`WARMUP_RUNS` real forwards on a side stream (PyTorch's recipe before a capture); the last output."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_RUNS):
                out = run_forward(*buffers)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, run_forward, buffers: list[torch.Tensor]):
        """Capture `run_forward(*buffers)` in a `torch.cuda.CUDAGraph` (the model's shared memory pool); returns
        `(replay, static output)`: `replay()` reruns the forward on whatever the buffers hold, into the output."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            static_out = run_forward(*buffers)
        return graph.replay, static_out


class _StaticState:
    """What persists on a model across calls for one role (target or drafter): its cache and its graphs."""

    def __init__(self, num_layers: int, max_cache_len: int) -> None:
        self.cache = RowStaticCache(num_layers, max_cache_len)
        self.graphs = _CudaGraphs()


def _num_layers(model) -> int:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def _state_of(model, role: str, batch_size: int, max_cache_len: int) -> _StaticState:
    """The model's static state for `role`, reused when it holds `batch_size` rows and `max_cache_len` columns
    (rounded up to :data:`LENGTH_GRANULE`), else a new one (the old buffers and graphs are dropped)."""
    states = model.__dict__.setdefault(STATE_ATTRIBUTE, {})
    state = states.get(role)
    length = _round_up(max_cache_len, LENGTH_GRANULE)
    if state is not None and (state.cache.batch_capacity or batch_size) >= batch_size:
        if state.cache.max_cache_len < length:
            state.cache.grow(length)
            state.graphs = _CudaGraphs()                          # captured against the old buffers
        return state
    if state is not None:
        length = max(length, state.cache.max_cache_len)
    state = states[role] = _StaticState(_num_layers(model), length)
    return state


def clear_static_state(model) -> None:
    """Drop the static caches and captured graphs `model` keeps across `generate` calls (frees their memory)."""
    model.__dict__.pop(STATE_ATTRIBUTE, None)


# -- the runner -------------------------------------------------------------------------------------------------
class StaticModelRunner(ModelRunner):
    """:class:`~hf_dllm_spec.runtime.runner.ModelRunner` over a static cache with a write position per row.

    Same interface and results as the eager runner (tokens, forward counts, the right-shift carry); see the module
    docstring for the layout.

    Args:
        model (`PreTrainedModel`): the model, in eval mode.
        patch (`model_patches.FamilyPatch`): its family adapter.
        stats (`BatchStats`): per-row forward counters to update.
        batch_size (`int`): N.
        max_cache_len (`int`): columns per row to allocate (stored tokens plus one query width); a forward that needs
            more reallocates the cache (and, on CUDA, captures its graphs again).
        compile_mode (`str`, defaults to "eager"): "eager", "cuda_graph" or "compile" (:func:`compile_plan`).
        compile_config (`CompileConfig`, *optional*): for "compile".
        compile_reason (`str`, defaults to ""): why compilation is off, for :attr:`runtime_note`.
        timer (`ForwardTimer`, *optional*), timer_span (`str`, *optional*): as the eager runner; graph captures
            (and the first compiled call) are also timed under "warmup".

    Raises:
        ValueError: if `compile_mode` is not one of the three.
    """

    COMPILE_MODES = ("eager", "cuda_graph", "compile")

    def __init__(self, model, patch, stats: BatchStats, *, batch_size: int, max_cache_len: int,
                 compile_mode: str = "eager", compile_config=None, compile_reason: str = "",
                 timer: ForwardTimer | None = None, timer_span: str | None = None) -> None:
        if compile_mode not in self.COMPILE_MODES:
            raise invalid("compile_mode", compile_mode, f"be one of {self.COMPILE_MODES}",
                          "use `compile_plan(model, generation_config)`")
        dtype = model.dtype if model.dtype.is_floating_point else torch.float32
        role = f"{'drafter' if timer_span == DRAFT_MODEL_SPAN else 'target'}:{dtype}:{execution_device(model)}"
        self._state = _state_of(model, role, batch_size, max_cache_len)
        super().__init__(model, patch, stats, batch_size=batch_size, cache=self._state.cache, timer=timer,
                         timer_span=timer_span)
        self.compile_mode = compile_mode
        self.runtime_note = f"static cache, {compile_mode}" + (f" ({compile_reason})" if compile_reason else "")
        self._call = (_CallProxy(model.get_compiled_call(compile_config)) if compile_mode == "compile" else model)
        self._compiled_keys: set = model.__dict__.setdefault("_hf_dllm_spec_compiled_keys", set())
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)     # write position per row
        self._bound = 0                          # host-side upper bound of max(lengths), no sync to keep it
        self._offsets: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def stored_len(self) -> int:
        """An upper bound of the longest row's stored tokens (exact after a discard, a sync, or a growth check)."""
        return self._bound

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, intra_mask: torch.Tensor, *, kind: str,
                store_len: int = 0, store_valid: torch.Tensor | None = None, logits_to_keep: int = 0,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`ModelRunner.forward` (same arguments, same logits, same counters), at a fixed width.

        The query is padded at the front to `W =` :func:`width_bucket` `(q)` tokens that see only themselves; its
        K/V go to columns `lengths[n] + [0, W)` of each row (stored tokens first); `lengths` then advances by each
        row's real stored tokens.

        Returns:
            `torch.Tensor` of shape `(N, n, V)`, float32 logits aligned as the eager runner's.

        Raises:
            ValueError: as :meth:`ModelRunner.forward` (with `check_layouts`).
        """
        n, q = input_ids.shape
        s = store_len
        device = self.device
        intra, query_valid, keep, keep_raw = self._prepare_query(n, q, intra_mask, s, store_valid, logits_to_keep)
        width = width_bucket(q)
        kept = min(width, width_bucket(keep_raw))
        self.stats.count_forward(kind, rows, draft_model=self.timer_span == DRAFT_MODEL_SPAN)

        # Write columns (N, W): real stored tokens, read-only tokens, stored padding, then the query's front padding.
        front = width - q
        if store_valid is None:                    # no stored padding: the same offsets for every row (kept)
            stored = torch.full((n,), s, dtype=torch.long, device=device)
            offset = self._plain_offsets(width, front)                                    # (1, W)
        else:
            stored = store_valid.sum(dim=1)                                               # (N,)
            j = torch.arange(q, device=device)[None]                                      # (1, q)
            pad = (s - stored)[:, None]                                                   # stored padding per row
            offset = torch.where(j >= s, stored[:, None] + j - s,
                                 torch.where(j >= pad, j - pad, stored[:, None] + q - s + j))
            offset = torch.cat([torch.arange(q, width, device=device).expand(n, front), offset], dim=1)   # (N, W)
        self._ensure_length(width)
        columns = self.lengths[:, None] + offset
        if front:                                  # the query padded at the front to its width bucket
            wide = torch.zeros(n, width, width, dtype=torch.bool, device=device)          # query visibility
            wide[:, front:, front:] = intra
            wide[:, :front, :front] = torch.eye(front, dtype=torch.bool, device=device)
            ids = torch.zeros(n, width, dtype=input_ids.dtype, device=device)
            ids[:, front:] = input_ids
            pos = torch.zeros(n, width, dtype=position_ids.dtype, device=device)
            pos[:, front:] = position_ids
        else:                                      # already at its bucket: no copies
            wide, ids, pos = intra, input_ids, position_ids
        with self.timer.span("forward"), self._own_span(), self._traced(kind, n, width, s, kept):
            raw = self._run(ids, pos, wide, columns, kept)[:, kept - keep_raw:]
        self.lengths = self.lengths + stored
        self._bound += s
        if self.alignment == "position":
            return raw[:, -keep:]
        return self._align_right_shift(raw, query_valid, q, keep, s)

    def _run(self, ids, pos, wide, columns, kept) -> torch.Tensor:
        """One forward of the padded query (eager, replayed graph or compiled call); `(N, kept, V)` float32.

        The attention mask `(N, 1, W, L)` is built inside (so a CUDA graph replays it with the forward): row n's
        stored columns `[0, lengths[n])` are visible to every query token, and the query's own columns follow
        `wide` `(N, W, W)`."""
        dtype = self.dtype

        def run_forward(ids, pos, wide, columns, lengths):
            n, width = ids.shape
            length = self.cache.max_cache_len
            visible = (torch.arange(length, device=ids.device)[None, None, :] < lengths[:, None, None]).expand(
                n, width, length).clone()
            visible.scatter_(2, columns[:, None, :].expand(n, width, width), wide)
            return self.patch.forward(self._call, ids, position_ids=pos, attention_mask=to_additive(visible, dtype),
                                      cache=self.cache, logits_to_keep=kept)

        key = (ids.shape[0], ids.shape[1], kept, self.cache.max_cache_len)
        if self.compile_mode == "cuda_graph" and self._state.graphs.failed:
            self.compile_mode, self.runtime_note = "eager", f"static cache, eager ({self._state.graphs.failed})"
        if self.compile_mode == "cuda_graph":
            first = key[:3] not in self._state.graphs.graphs
            with self.timer.span("warmup") if first else contextlib.nullcontext():
                return self._state.graphs.run(key[:3], run_forward, (ids, pos, wide, columns, self.lengths),
                                              self.cache)
        self.cache.set_write_columns(columns)
        if self.compile_mode == "compile":
            if torch.cuda.is_available() and ids.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()
            first = key not in self._compiled_keys
            self._compiled_keys.add(key)
            with self.timer.span("warmup") if first else contextlib.nullcontext():
                return run_forward(ids, pos, wide, columns, self.lengths).clone()
        return run_forward(ids, pos, wide, columns, self.lengths)

    def _plain_offsets(self, width: int, front: int) -> torch.Tensor:
        """`(1, W)` int64 write offsets of a query without stored padding: its `q = W - front` tokens at `[0, q)`
        in order, then its front padding at `[q, W)` (cached per `(W, front)`)."""
        key = (width, front)
        if key not in self._offsets:
            self._offsets[key] = ((torch.arange(width, device=self.device) - front) % width)[None]
        return self._offsets[key]

    def _ensure_length(self, width: int) -> None:
        """Make room for `width` more columns after the longest row: sync the exact bound, grow if still short."""
        if self._bound + width <= self.cache.max_cache_len:
            return
        self._bound = int(self.lengths.max()) if self.batch_size else 0
        need = self._bound + width
        if need > self.cache.max_cache_len:
            self.cache.grow(_round_up(max(need, 2 * self.cache.max_cache_len), LENGTH_GRANULE))
            self._state.graphs = _CudaGraphs()                    # captured against the old buffers

    def discard_tail(self, num_discard: torch.Tensor, carry: torch.Tensor | None = None) -> None:
        """Forget the last `num_discard[n]` stored tokens of each row: its write position moves back (the columns
        are overwritten by the next forward, and no query sees them until then).

        Args:
            num_discard (`torch.Tensor` of shape `(N,)`, int64): tokens to drop per row.
            carry (`torch.Tensor` of shape `(N, V)`, *optional*): right-shifted models: the logits of each row's
                last kept token; required for them.

        Raises:
            ValueError: if a right-shifted model gets no `carry`.
        """
        if self.alignment != "position" and carry is None:
            raise ValueError("StaticModelRunner.discard_tail: a right-shifted model needs `carry`, the logits of "
                             "each row's last kept token.")
        self.lengths = self.lengths - num_discard.to(self.device)
        if carry is not None:
            self.carry = carry

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `(M,)` int64, in that order: moved to the first M rows of the static buffers."""
        index = index.to(self.device)
        self.cache.select_rows(index)
        self.lengths = self.lengths[index]
        if self.carry is not None:
            self.carry = self.carry[index]


# -- selection --------------------------------------------------------------------------------------------------
def static_cache_length(prompt_width: int, max_new_tokens: int, block_size: int) -> int:
    """Columns per row to allocate for a call: the padded prompt's width bucket, or the prompt, the budget and
    room for a few blocks of read-only queries (verify layouts, drafts), whichever is larger. A longer need
    reallocates (:meth:`StaticModelRunner._ensure_length`)."""
    return max(width_bucket(prompt_width), prompt_width + max_new_tokens + 4 * block_size + LENGTH_GRANULE)


def drop_prepared_static_cache(generation_config: GenerationConfig, model_kwargs: dict[str, Any]) -> None:
    """With `cache_implementation="static"`, remove the (lazy, still empty) `StaticCache` transformers' `generate`
    prepared in `model_kwargs`: the static runtime keeps its own per-row cache on the model. A cache the caller
    passed is left (transformers refuses a cache together with `cache_implementation` itself)."""
    if generation_config.cache_implementation != "static":
        return
    cache = find_cache(model_kwargs)
    if isinstance(cache, StaticCache) and not getattr(cache, "_is_user_defined", False):
        pop_cache(model_kwargs)


def make_runner(model, patch, stats: BatchStats, *, batch_size: int, generation_config: GenerationConfig,
                max_cache_len: int, use_cache: bool = True, cache=None, timer: ForwardTimer | None = None,
                timer_span: str | None = None) -> ModelRunner:
    """The runner `generate` uses for `model`: :class:`StaticModelRunner` when
    `generation_config.cache_implementation == "static"`, else the eager :class:`ModelRunner`.

    Args:
        max_cache_len (`int`): static runtime: columns per row to allocate (a longer need reallocates);
            `generation_config.max_cache_len` (transformers >= 5.24), when larger, sizes it instead.
        use_cache, cache: eager runner only (the checks refuse a cache or `use_cache=False` with "static").
        Others: as the runners'.
    """
    if generation_config.cache_implementation != "static":
        return ModelRunner(model, patch, stats, batch_size=batch_size, use_cache=use_cache, cache=cache, timer=timer,
                           timer_span=timer_span)
    mode, reason = compile_plan(model, generation_config)
    if reason and generation_config.compile_config is not None and not generation_config.disable_compile:
        logger.warning("hf_dllm_spec: `compile_config` is set but %s is not compiled: %s.",
                       type(model).__name__, reason)
    max_cache_len = max(max_cache_len, getattr(generation_config, "max_cache_len", None) or 0)
    return StaticModelRunner(model, patch, stats, batch_size=batch_size, max_cache_len=max_cache_len,
                             compile_mode=mode, compile_config=generation_config.compile_config,
                             compile_reason=reason, timer=timer, timer_span=timer_span)


__all__ = ["RowStaticCache", "RowStaticLayer", "StaticModelRunner", "clear_static_state", "compile_plan",
           "drop_prepared_static_cache", "make_runner", "static_cache_length", "width_bucket"]
