"""The static decoding runtime: a preallocated K/V cache with a write position per row, fixed query widths, and
forwards captured once and replayed (CUDA graphs) or compiled.

`generate(..., cache_implementation="static")` selects it (transformers' name for its own static cache); the
default stays the eager :class:`~hf_dllm_spec.runtime.runner.ModelRunner`. :class:`StaticModelRunner` has the eager
runner's interface (`forward`, `discard_tail`, `select_rows`, `carry`, `batch_size`, the stats and timer), so every
strategy runs on it unchanged, and it gives the eager runner's tokens and forward counts.

Layout (:mod:`~hf_dllm_spec.runtime.static_cache`). Each layer holds K/V of shape `(R, kv_heads, L, head_dim)`.
Row n has a write position `lengths[n]`: its stored tokens are the columns `[0, lengths[n])`, in order, and nothing
else. A forward of `q` query tokens, padded to a width bucket `W >= q` (:func:`width_bucket`; the padding goes first
in the query and sees only itself), writes all `W` K/V at columns `lengths[n] + [0, W)`: first the row's real stored
tokens, then the read-only tokens, then padding; only the stored tokens advance `lengths[n]`. Read-only tokens
(drafts, the verifier's copies) are thus written past the write position and never become visible. No
`torch.cat`, no crop; `discard_tail` moves the write position back and `select_rows` gathers rows into the leading
rows of the same buffers.

Fixed shapes. Every forward takes input ids, positions and write columns `(n, W)`, the query's own visibility
`(n, W, W)` and the write positions `(n,)`, and attends over a prefix of `P` columns (:func:`prefix_bucket` of the
longest row plus `W`: the cost follows the rows' lengths, not the largest cache ever allocated); it builds its
float mask `(n, 1, W, P)` inside. Captured and compiled forwards also pad the batch to a row bucket
(:func:`rows_bucket`; the extra rows write into unused rows of the buffers and are dropped), so a batch that drains
as rows finish replays the graphs of a few bucket sizes instead of capturing one per row count. On CUDA each
`(rows, W, kept logits, P)` is captured once (:class:`~hf_dllm_spec.runtime.graphs.CapturedForwards`: under the
model's own device, at most `max_graphs` per model and role, least recently used first out, one memory pool, the
first replay checked against eager, a failed capture cleaned up and retried once on a later call); with
`compile_config` each fixed-shape forward is compiled once (torch.compile with the config's options, transformers'
meaning; one code object per shape, so models and shapes never share dynamo's recompile limit). A strategy whose
step is a function of tensors runs the whole step, forward and maths, as one captured graph or one compiled function
(:meth:`StaticModelRunner.run_step`, :mod:`~hf_dllm_spec.runtime.step`). MoE experts that could not be captured in
the model's dtype run transformers' "batched_mm" kernel meanwhile (:mod:`~hf_dllm_spec.runtime.experts`). Which
mode, and why not another, follows transformers' `_valid_auto_compile_criteria` plus the bitsandbytes rules
(:func:`compile_plan`).

Across calls and threads. Cache, graphs and options live on the model (:func:`static_states`,
:func:`clear_static_state`, :func:`configure_static_runtime`) and are reused by later calls with the same or
smaller shapes (a longer need doubles the cache and drops the graphs). All of it is created outside
`torch.inference_mode`, so the first call's autograd mode does not bind later calls. One `generate` call at a time
uses a model's static state (:func:`hold_static_runtime`): a call from another thread waits its turn; a nested call
from the same thread (a streamer that generates) is refused with the rule and the fix.

Host synchronisations. No forward of any family reads a device value on the host (so each can be captured), and
the decoding loop reads the device once per forward at batch 1 (`hf_dllm_spec.runtime.syncs`, counted in
`tests/test_static_runtime.py`).

Source: issues 25 and 32 (measurements on an H100 in `shared/reference/platform.md`, "Static caches, compilation
and CUDA graphs" and "CUDA graphs: what breaks a capture"); transformers `StaticCache` / `StaticLayer`,
`CompileConfig`; PyTorch "CUDA Graphs" (whole-network capture).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.cache_utils import StaticCache

from model_patches.compat import find_cache, pop_cache

from ..maths.masks import to_additive
from ..bridge import prepared_by_generate, transformers_compiles
from ..outputs import BatchStats
from ..tracing import recording_step
from ..validation import invalid
from .experts import capturable_experts, experts_configs, experts_implementation
from .graphs import DEFAULT_MAX_GRAPHS, CapturedForwards, fresh_copies, with_zero_rows
from .weights import execution_device
from .runner import DRAFT_MODEL_SPAN, ModelRunner, align_right_shift
from .static_cache import RowStaticCache, RowStaticLayer
from .step import CompiledSteps, compile_options
from .timing import ForwardTimer

logger = logging.getLogger(__name__)

#: Query widths up to this are padded to the next power of two; wider ones to a multiple of it.
WIDTH_GRANULE = 256
#: Cache lengths are rounded up to a multiple of this; attended prefixes are at least this long.
LENGTH_GRANULE = 64
#: The attribute of a model that holds its static runtime (states per role, options, the call lock).
STATE_ATTRIBUTE = "_hf_dllm_spec_static"


def width_bucket(width: int) -> int:
    """The fixed query width a forward of `width` (>= 1) tokens runs at: the next power of two up to
    :data:`WIDTH_GRANULE`, then the next multiple of it (1, 2, 4, ..., 256, 512, 768, ...)."""
    if width <= WIDTH_GRANULE:
        return 1 << max(0, width - 1).bit_length()
    return -(-width // WIDTH_GRANULE) * WIDTH_GRANULE


def rows_bucket(rows: int, capacity: int) -> int:
    """The batch rows a captured or compiled forward of `rows` (>= 1) live rows runs at: the next power of two,
    at most `capacity` (the rows the buffers hold). A batch of N that drains runs at most log2(N) + 1 sizes."""
    return min(1 << max(0, rows - 1).bit_length(), capacity)


def prefix_bucket(need: int, max_cache_len: int) -> int:
    """The cache columns a forward attends over when its rows need `need` of them (the longest row's stored
    tokens plus the query width): the next power of two, at least :data:`LENGTH_GRANULE`, at most the allocated
    `max_cache_len`."""
    return min(max(LENGTH_GRANULE, 1 << max(0, need - 1).bit_length()), max_cache_len)


def _pad_batch(tensors: tuple, rows: int) -> tuple:
    """`tensors` (`(n, ...)` each, None, or already `(rows, ...)`) padded to `rows` rows with zero rows."""
    return tuple(t if t is None or t.shape[0] == rows else with_zero_rows(t, rows) for t in tensors)


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


# -- how the forwards run ---------------------------------------------------------------------------------------
def _bitsandbytes_bits(quantizer) -> int | None:
    """4 or 8 for a bitsandbytes quantizer, else None."""
    config = getattr(quantizer, "quantization_config", None)
    method = getattr(config, "quant_method", None)
    if str(getattr(method, "value", method)) != "bitsandbytes":          # transformers' QuantizationMethod enum
        return None
    return 4 if getattr(config, "load_in_4bit", False) else 8 if getattr(config, "load_in_8bit", False) else None


def compile_plan(model, generation_config: GenerationConfig) -> tuple[str, str]:
    """How the static runtime runs `model`'s forwards, by transformers' rule for `generate`
    (`GenerationMixin._valid_auto_compile_criteria`) plus the bitsandbytes rules of CUDA graphs, and why.

    Returns:
        `(mode, reason)`: mode "eager" (forwards run as they are, over the static cache), "cuda_graph" (each
        fixed-shape forward and decoding step captured once in a `torch.cuda.CUDAGraph`; the default on CUDA) or
        "compile" (`torch.compile` with the `compile_config`'s options, transformers' meaning, each fixed-shape
        forward and step compiled once, when a `compile_config` is given); `reason` is one line saying why (empty
        for the plain default).

    bitsandbytes: 8-bit (LLM.int8) layers are not capturable, so the forwards stay eager with that reason; 4-bit
    layers are captured, each capture checked against its eager forward on its first replay (bitsandbytes#1308
    reports wrong 4-bit outputs under CUDA graphs: a graph that differs is dropped and the model runs eager, with
    the reason in `spec_stats.runtime`); neither is compiled (`HfQuantizer.is_compileable` is False).
    """
    config = generation_config.compile_config
    device = execution_device(model)
    bits = _bitsandbytes_bits(getattr(model, "hf_quantizer", None))
    compiles, reason = transformers_compiles(model, generation_config, device, ignore_quantizer=bits is not None)
    if not compiles:
        return "eager", reason
    if bits == 8:
        return "eager", "bitsandbytes 8-bit layers cannot be captured in CUDA graphs"
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size > 1:
        return "eager", f"tensor-parallel model (tp_size={tp_size}): capturing or compiling its collectives is not " \
                        "verified yet"
    if config is not None:
        if bits is not None:
            return "eager", "bitsandbytes weights cannot be compiled (transformers' `HfQuantizer.is_compileable` " \
                            "is False); drop `compile_config` to capture 4-bit layers in CUDA graphs"
        return "compile", ""
    if len({p.device for p in model.parameters()}) > 1:
        return "eager", "CUDA graphs need the whole model on one device (pass a `compile_config` to use torch.compile)"
    if bits == 4:
        return "cuda_graph", "bitsandbytes 4-bit: each capture checked against its eager forward"
    return "cuda_graph", ""


# -- what persists on a model -----------------------------------------------------------------------------------
class _StaticState:
    """What persists on a model across calls for one role (target or drafter): its cache and its graphs."""

    def __init__(self, num_layers: int, max_cache_len: int, rows: int, device: torch.device,
                 max_graphs: int) -> None:
        self.cache = RowStaticCache(num_layers, max_cache_len, rows)
        self.graphs = CapturedForwards(device, max_graphs)
        self.steps = CompiledSteps()

    def reallocated(self) -> None:
        """The cache buffers moved (grown): drop what was captured or compiled against them."""
        self.graphs.clear()
        self.steps.clear()


class _CallLock:
    """One `generate` call at a time on a model's static state: other threads wait, the same thread is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    @contextlib.contextmanager
    def hold(self, name: str):
        me = threading.get_ident()
        if self._owner == me:
            raise invalid("cache_implementation", "static", f"be used by one `generate` call at a time on {name}: "
                          "this thread is already inside a static-runtime call on it (a streamer or criterion that "
                          "calls `generate` again)", "pass cache_implementation=None (the eager runtime) to the "
                          "inner call, or use another model instance for it")
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


class _ModelStatic:
    """Everything the static runtime keeps on one model: a state per role, the graph bound, the call lock.
    Copies of the model (`copy.deepcopy`, pickling) get a fresh, empty one."""

    def __init__(self) -> None:
        self.states: dict[str, _StaticState] = {}
        self.max_graphs = DEFAULT_MAX_GRAPHS
        self.lock = _CallLock()

    def __reduce__(self):
        return _ModelStatic, ()


def _holder(model) -> _ModelStatic:
    return model.__dict__.setdefault(STATE_ATTRIBUTE, _ModelStatic())


def _num_layers(model) -> int:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def _state_of(model, role: str, batch_size: int, max_cache_len: int) -> _StaticState:
    """The model's static state for `role`, reused when it holds `batch_size` rows (a longer cache doubles it and
    drops its graphs), else a new one of twice the rows, its cache at least as long (the failure record kept)."""
    holder = _holder(model)
    state = holder.states.get(role)
    length = _round_up(max_cache_len, LENGTH_GRANULE)
    if state is not None and state.cache.batch_capacity >= batch_size:
        if state.cache.max_cache_len < length:
            state.cache.grow(_round_up(max(length, 2 * state.cache.max_cache_len), LENGTH_GRANULE))
            state.reallocated()                                   # captured against the old buffers
        return state
    rows = 1 << max(0, batch_size - 1).bit_length()
    if state is not None:
        length = max(length, state.cache.max_cache_len)
    new = holder.states[role] = _StaticState(_num_layers(model), length, rows, execution_device(model),
                                             holder.max_graphs)
    if state is not None:
        new.graphs.failure = state.graphs.failure
    return new


def static_states(model) -> list:
    """The static states `model` keeps (one per role it ran in: target or drafter, per dtype and device); each has
    `.cache` (:class:`RowStaticCache`) and `.graphs` (:class:`~hf_dllm_spec.runtime.graphs.CapturedForwards`:
    `captures`, `evictions`, `failure`, the graphs)."""
    holder = model.__dict__.get(STATE_ATTRIBUTE)
    return list(holder.states.values()) if holder is not None else []


def clear_static_state(model) -> None:
    """Drop the static caches, captured graphs and capture-failure records `model` keeps across `generate` calls
    (frees their memory; the next static call allocates and captures afresh). The options stay."""
    holder = model.__dict__.get(STATE_ATTRIBUTE)
    if holder is not None:
        holder.states = {}


def configure_static_runtime(model, *, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
    """Set how many CUDA graphs the static runtime keeps for `model`, per role (target or drafter, per dtype and
    device); past it the least recently used graph is dropped (and captured again when needed).

    Args:
        model (`PreTrainedModel`): the model.
        max_graphs (`int`, defaults to :data:`~hf_dllm_spec.runtime.graphs.DEFAULT_MAX_GRAPHS`): at least 1.

    Raises:
        ValueError: if `max_graphs` is not an integer >= 1.
    """
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise invalid("max_graphs", max_graphs, "be an integer >= 1 (graphs kept per model and role)",
                      f"pass e.g. max_graphs={DEFAULT_MAX_GRAPHS}")
    holder = _holder(model)
    holder.max_graphs = max_graphs
    for state in holder.states.values():
        state.graphs.bound(max_graphs)


@contextlib.contextmanager
def hold_static_runtime(generation_config: GenerationConfig, *models):
    """Hold the static state of each of `models` (None entries skipped) for one `generate` call, with
    `cache_implementation="static"` (nothing otherwise): a call on another thread waits until this one ends.
    Locks are taken in one global order, so two calls that share models never wait on each other in a circle.

    Raises:
        ValueError: if this thread already holds one of them (a nested static call on the same model).
    """
    if generation_config.cache_implementation != "static":
        yield
        return
    unique = {id(model): model for model in models if model is not None}
    with contextlib.ExitStack() as stack:
        for key in sorted(unique):
            model = unique[key]
            stack.enter_context(_holder(model).lock.hold(type(model).__name__))
        yield


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
        device = execution_device(model)
        role = f"{'drafter' if timer_span == DRAFT_MODEL_SPAN else 'target'}:{dtype}:{device}{_autocast_of(device)}"
        self._state = _state_of(model, role, batch_size, max_cache_len)
        super().__init__(model, patch, stats, batch_size=batch_size, cache=self._state.cache, timer=timer,
                         timer_span=timer_span)
        self.compile_mode = compile_mode
        # bitsandbytes 4-bit graphs may replay other numbers (bitsandbytes#1308): only the forwards are captured,
        # each checked on its logits; a step's tokens could match on the check and differ later.
        self._captures_steps = (compile_mode == "cuda_graph"
                                and _bitsandbytes_bits(getattr(model, "hf_quantizer", None)) is None)
        self._compile_reason = compile_reason
        self._call_id = self._state.graphs.begin_call()
        self._whole_steps = 0                    # decoding steps this call ran compiled or captured whole
        self._experts, experts_reason = capturable_experts(model, compile_mode, device)
        self._experts_note = f"; experts: {self._experts} ({experts_reason})" if self._experts else ""
        self._experts_configs = experts_configs(model) if self._experts else []
        self._step_options = compile_options(compile_config) if compile_mode == "compile" else None
        self._forward_options = (compile_options(compile_config, fullgraph=bool(compile_config.fullgraph))
                                 if compile_mode == "compile" else None)
        # Compiled functions are kept on the model across calls: a call with other options compiles its own.
        self._options_key = repr(sorted(self._forward_options.items())) if compile_mode == "compile" else None
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)     # write position per row
        self._bound = 0                          # host-side upper bound of max(lengths), no sync to keep it
        self._offsets: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def runtime_note(self) -> str:
        """What ran this model's forwards, for `spec_stats.runtime`: the mode, why not another, whether the
        strategy's decoding steps ran whole (forward and maths compiled or captured together, :meth:`run_step`) or
        the forwards alone, the experts kernel and any capture failure with its reason."""
        notes = [self._compile_reason] if self._compile_reason else []
        if self.compile_mode == "cuda_graph":
            failure = self._state.graphs.note(self._call_id)
            if failure:
                notes.append(failure)
        note = f"static cache, {self.compile_mode}" + (f" ({'; '.join(notes)})" if notes else "")
        if self.compile_mode != "eager":
            note += ", whole steps" if self._whole_steps else ", forwards only"
        return note + self._experts_note

    @property
    def stored_len(self) -> int:
        """An upper bound of the longest row's stored tokens (exact after a discard, a sync, or a growth check)."""
        return self._bound

    @property
    def batch_size(self) -> int:
        """N, the rows in the batch now (`int`; at most the static buffers' row capacity)."""
        return self.lengths.shape[0]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, intra_mask: torch.Tensor, *, kind: str,
                store_len: int = 0, store_valid: torch.Tensor | None = None, logits_to_keep: int = 0,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`ModelRunner.forward` (same arguments, same logits, same counters), at fixed shapes.

        The query is padded at the front to `W =` :func:`width_bucket` `(q)` tokens that see only themselves; its
        K/V go to columns `lengths[n] + [0, W)` of each row (stored tokens first); `lengths` then advances by each
        row's real stored tokens. Captured and compiled forwards also pad the batch to :func:`rows_bucket` rows.

        Returns:
            `torch.Tensor` of shape `(N, n, V)`, float32 logits aligned as the eager runner's.

        Raises:
            ValueError: as :meth:`ModelRunner.forward` (with `check_layouts`).
        """
        n, q = input_ids.shape
        s = store_len
        intra, query_valid, keep, keep_raw = self._prepare_query(n, q, intra_mask, s, store_valid, logits_to_keep)
        width, kept, prefix = self.reserve(q, keep_raw)
        self.stats.count_forward(kind, rows, draft_model=self.timer_span == DRAFT_MODEL_SPAN)
        inputs, stored = self._layout(input_ids, position_ids, intra, s, store_valid, width, self.lengths)
        if self.compile_mode != "eager":
            inputs = _pad_rows(inputs, rows_bucket(n, self.cache.batch_capacity))
        with self.timer.span("forward"), self._own_span(), self._traced(kind, n, width, s, kept):
            raw = self._run(inputs, kept, prefix)[:n, kept - keep_raw:]
        self.lengths = self.lengths + stored
        self._bound += s
        if self.alignment == "position":
            return raw[:, -keep:]
        return self._align_right_shift(raw, query_valid, q, keep, s)

    def reserve(self, q: int, keep_raw: int) -> tuple[int, int, int]:
        """The fixed shapes of a forward of `q` query tokens that computes `keep_raw` logits, decided on the host:
        `(W, kept, P)`, the query's width bucket, the logits the padded forward computes and the attended prefix;
        makes room for `W` more columns first (:meth:`_ensure_length`)."""
        width = width_bucket(q)
        self._ensure_length(width)
        return width, min(width, width_bucket(keep_raw)), prefix_bucket(self._bound + width, self.cache.max_cache_len)

    def _layout(self, input_ids: torch.Tensor, position_ids: torch.Tensor, intra: torch.Tensor, s: int,
                store_valid: torch.Tensor | None, width: int, lengths: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """The query padded at the front to `width` and where its K/V go (pure tensor work, traceable).

        Args:
            intra (`torch.Tensor` of shape `(N, q, q)`, bool): from :meth:`_prepare_query`.
            lengths (`torch.Tensor` of shape `(N,)`, int64): the rows' write positions.

        Returns:
            `((ids, pos, wide, columns, lengths), stored)`: the forward's inputs at width `W` (see :meth:`_run`) and
            the real stored tokens per row `(N,)`. Write columns: real stored tokens, read-only tokens, stored
            padding, then the query's front padding.
        """
        n, q = input_ids.shape
        device = self.device
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
        columns = lengths[:, None] + offset
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
        return (ids, pos, wide, columns, lengths), stored

    def _call_model(self, ids: torch.Tensor, pos: torch.Tensor, wide: torch.Tensor, columns: torch.Tensor,
                    lengths: torch.Tensor, *, call, kept: int, prefix: int) -> torch.Tensor:
        """The model call over the static cache (cache columns already bound), `(rows, kept, V)` float32.

        The attention mask `(rows, 1, W, P)` is built here (so a CUDA graph replays it with the forward): row n's
        stored columns `[0, lengths[n])` are visible to every query token, and the query's own columns follow
        `wide` `(rows, W, W)`."""
        n, width = ids.shape
        visible = (torch.arange(prefix, device=ids.device)[None, None, :] < lengths[:, None, None]).expand(
            n, width, prefix).clone()
        visible.scatter_(2, columns[:, None, :].expand(n, width, width), wide)
        with experts_implementation(self._experts_configs, self._experts):
            return self.patch.forward(call, ids, position_ids=pos, attention_mask=to_additive(visible, self.dtype),
                                      cache=self.cache, logits_to_keep=kept)

    def _run(self, inputs: tuple, kept: int, prefix: int) -> torch.Tensor:
        """One forward of the padded query (eager, replayed graph or compiled call); `(rows, kept, V)` float32.

        `inputs` is `(ids, pos, wide, columns, lengths)` (:meth:`_call_model`). Compiled (`compile_config`), the
        forward is compiled once per fixed shape `(rows, W, kept, P, cache length, cache rows)`, each its own code
        object (:class:`~hf_dllm_spec.runtime.step.CompiledSteps`, as the steps): the shapes of one model, or of
        several models in one process, never share dynamo's recompile limit (transformers' `get_compiled_call`
        compiles `nn.Module.__call__`, one code object for every model, and past the limit runs new shapes eagerly
        without a word). A call's first forward, before the buffers exist, runs eagerly (it allocates them)."""

        def run_forward(ids, pos, wide, columns, lengths):
            return self._call_model(ids, pos, wide, columns, lengths, call=self.model, kept=kept, prefix=prefix)

        def bind(buffers) -> None:
            self.cache.set_write_columns(buffers[3], prefix)

        ids = inputs[0]
        key = (ids.shape[0], ids.shape[1], kept, prefix)
        if self.compile_mode == "cuda_graph":
            graphs = self._state.graphs
            capture = key not in graphs.graphs and graphs.may_capture(self._call_id)
            with self.timer.span("warmup") if capture else contextlib.nullcontext():
                out = graphs.run(key, run_forward, inputs, bind, self._call_id)
            if out is not None:
                return out
        bind(inputs)
        if self.compile_mode == "compile" and self.cache.allocated:
            if torch.cuda.is_available() and ids.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()
            key = ("forward", self._options_key, *key, self.cache.max_cache_len, self.cache.batch_capacity)
            steps = self._state.steps
            with self.timer.span("warmup") if key not in steps else contextlib.nullcontext():
                return steps.run(key, compiled_forward, self._forward_options, self, kept, prefix, *inputs).clone()
        return run_forward(*inputs)

    # -- compiled steps (runtime/step.py) --------------------------------------------------------------------------
    @property
    def runs_compiled_steps(self) -> bool:
        """Whether :meth:`run_step` is available: forwards compiled (`compile_config`) or captured (CUDA graphs),
        a position-aligned model (no carry to keep across steps), layouts not checked (the check reads the device
        on every storing forward). A MoE experts kernel switch (:func:`~hf_dllm_spec.runtime.experts.
        experts_implementation`, LLaDA2 outside bfloat16) runs with the model call inside the step (compiled with
        `fullgraph`, the step's graph runs "batched_mm"). bitsandbytes 4-bit models capture their forwards only."""
        runs = self.compile_mode == "compile" or self._captures_steps
        return runs and self.alignment == "position" and not self.check_layouts

    @property
    def runs_compiled_carry_steps(self) -> bool:
        """Whether :meth:`run_step` is available to a step of a right-shifted model, which passes the carry to
        :meth:`step_forward` and, when it stores tokens, gets the new carry back (`return_carry`) and returns it to
        :meth:`run_step` (`sets_carry`): Fast-dLLM v2's denoising steps and cache writes, AR, DEER's verify."""
        runs = self.compile_mode == "compile" or self._captures_steps
        return runs and self.alignment == "right_shift" and not self.check_layouts

    def run_step(self, function, owner, key: tuple, tensors: tuple, *, q: int, store_len: int, logits_to_keep: int,
                 kind: str, rows=None, sets_carry: bool = False) -> list:
        """One decoding step, forward and maths, as one compiled function (:class:`~hf_dllm_spec.runtime.step.
        CompiledSteps`, kept on the model per role) or, in the "cuda_graph" mode, one CUDA graph
        (:class:`~hf_dllm_spec.runtime.graphs.CapturedForwards`, the forwards' table and pool; the step's tensors
        copied into the graph's buffers before each replay): `function(owner, self, shape, lengths, *tensors)`.

        `function` runs exactly one forward, :meth:`step_forward` of `q` query tokens (the first `store_len`
        stored, `logits_to_keep` logits kept), whose fixed `shape` is decided here; it returns `(lengths, *outputs)`,
        the rows' new write positions first. The batch is padded to :func:`rows_bucket` rows (zero rows: each
        tensor's extra rows are zeros, and their K/V go to unused rows of the buffers; a captured step zeroes
        them in its graph's buffers instead of making padded tensors) and the outputs cut back.
        Counted as one forward of `kind` for `rows` (:meth:`forward`'s counters). A call's first forward, before
        the cache's buffers exist, runs `function` eagerly (it allocates them). With `sets_carry` (a
        right-shifted model's step that stores tokens) it returns `(lengths, carry, *outputs)`, and the carry
        `(N, V)` (:meth:`step_forward` with `return_carry`) becomes the runner's.

        Args:
            function (`Callable`): a plain function of tensors (no host read, no random draw, no Python state
                changed, no tensor read but its arguments, the model's weights and the static cache: a graph replays
                what it read at capture).
            owner: its first argument (the strategy).
            key (`tuple`): the owner's part of the compile key (its rule and parameters).
            tensors (`tuple`): `(N, ...)` tensors or None, rows first; a tensor of :attr:`step_rows` rows (a
                fixed-shape step buffer whose extra rows are padding) is passed as it is.
            sets_carry (`bool`, defaults to False): right-shifted models: `function` returns `(lengths, carry,
                *outputs)`, the new carry `(N, V)` (the logits of each row's last stored token after the step) second;
                the runner keeps it as :attr:`carry`.

        Returns:
            `list` of the function's outputs, `(N, ...)` each.
        """
        n = self.batch_size
        width, kept, prefix = shape = self.reserve(q, self.logits_computed(q, logits_to_keep or q, store_len))
        self.stats.count_forward(kind, rows, draft_model=self.timer_span == DRAFT_MODEL_SPAN)
        bucket = rows_bucket(n, self.cache.batch_capacity)
        key = (*key, self._options_key, bucket, width, kept, prefix, self.cache.max_cache_len,
               self.cache.batch_capacity)
        tensors = (self.lengths, *tensors)        # `(n, ...)` each, or already `(bucket, ...)`: padded below
        if self.compile_mode == "compile":
            tensors = _pad_batch(tensors, bucket)
            table = self._state.steps
        else:     # a graph's buffers: the tensors given (which are None is part of its key) and the owner's inputs
            attributes = owner.graph_inputs() if hasattr(owner, "graph_inputs") else []
            read = [getattr(obj, name) for obj, name in attributes]
            key = ("step", *key, tuple(t is not None for t in tensors), tuple((t.shape, t.dtype) for t in read))
            table = self._state.graphs.graphs
        if self.compile_mode == "compile" and self.device.type == "cuda":      # (CUDA graph trees' step marker)
            torch.compiler.cudagraph_mark_step_begin()
        with self.timer.span("forward"), self._own_span(), self._traced(kind, n, width, store_len, kept), \
                self.timer.span("warmup") if key not in table else contextlib.nullcontext():
            outputs = None
            if self.cache.allocated and self.compile_mode == "compile":
                outputs = table.run(key, function, self._step_options, owner, self, shape, *tensors)
            elif self.cache.allocated:
                outputs = self._captured_step(key, function, owner, shape, tensors, attributes, read, bucket)
            self._whole_steps += outputs is not None
            if outputs is None:    # the call's first forward allocates the buffers: eagerly (a graph would guard on
                outputs = function(owner, self, shape, *_pad_batch(tensors, bucket))   # them); or no capture
        lengths, *outputs = outputs
        if bucket > n:       # (a replayed graph's outputs come back cut)
            lengths, *outputs = (t if t.shape[0] == n else t[:n] for t in (lengths, *outputs))
        if self.compile_mode == "compile" and self.device.type == "cuda":   # CUDA graph trees reuse their output
            lengths, *outputs = fresh_copies((lengths, *outputs))               # memory at the next replay
        if sets_carry:
            self.carry, *outputs = outputs
        self.lengths = lengths
        self._bound += store_len
        return outputs

    def _captured_step(self, key: tuple, function, owner, shape: tuple, tensors: tuple,
                       attributes: list[tuple[object, str]], read: list[torch.Tensor], bucket: int) -> tuple | None:
        """:meth:`run_step`'s step replayed from its CUDA graph, captured on its key's first use; None where this
        call may not capture (after a failed capture: the step then runs eagerly). `tensors` `(lengths, *tensors)`,
        the None ones left out of the graph's buffers (`key` says which are present); those of fewer rows than
        `bucket` fill their buffers' first rows, the rest of the buffer zeros (the padding :meth:`run_step`
        describes, made in the graph's buffers instead of new tensors). What the step reads through `attributes`
        (`(object, name)`, the owner's `graph_inputs()`; `read`: their tensors now) is a graph input too: while the
        step is captured each attribute points at its buffer, and every replay first copies the attribute's tensor
        of the moment into it."""
        present = key[-2]
        given = [t for t in tensors if t is not None]
        inputs = given + read
        padded = [t.shape[0] != bucket for t in given] + [False] * len(read)

        def run(*buffers):
            given = iter(buffers)
            args = [next(given) if p else None for p in present]
            kept = [getattr(obj, name) for obj, name in attributes]
            try:
                for (obj, name), buffer in zip(attributes, given):
                    setattr(obj, name, buffer)
                return function(owner, self, shape, *args)
            finally:
                for (obj, name), value in zip(attributes, kept):
                    setattr(obj, name, value)

        return self._state.graphs.run(key, run, inputs, lambda buffers: None, self._call_id,
                                      padded=padded if any(padded) else None, rows=bucket)

    @property
    def step_rows(self) -> int:
        """The rows the next compiled step runs at: :func:`rows_bucket` of the batch (:meth:`run_step`)."""
        return rows_bucket(self.batch_size, self.cache.batch_capacity)

    def step_forward(self, shape: tuple[int, int, int], input_ids: torch.Tensor, position_ids: torch.Tensor,
                     intra_mask: torch.Tensor, lengths: torch.Tensor, *, store_len: int = 0,
                     store_valid: torch.Tensor | None = None, logits_to_keep: int = 0,
                     carry: torch.Tensor | None = None, return_carry: bool = False) -> tuple[torch.Tensor, ...]:
        """:meth:`forward` inside a compiled step (:meth:`run_step`): the same layout, mask and model call over the
        static cache at the fixed `shape` `(W, kept, P)`, from the rows' write positions `lengths` `(R,)`.

        A right-shifted model (:attr:`runs_compiled_carry_steps`) takes the carry as an argument, `carry` `(R, V)`
        (the runner's :attr:`carry`, rows padded like the step's other tensors). A query that stores tokens changes
        the carry: it needs `return_carry=True`, and the step returns the new carry to :meth:`run_step`
        (`sets_carry=True`).

        Returns:
            `(logits, lengths)`, or `(logits, lengths, carry)` with `return_carry`: `(R, n, V)` float32 logits as
            :meth:`forward` returns them, the new write positions `(R,)`, and the carry after the query `(R, V)`
            (None on a position-aligned model).

        Raises:
            ValueError: a right-shifted model's step without `carry`, or one that stores tokens without
                `return_carry`.
        """
        width, kept, prefix = shape
        n, q = input_ids.shape
        intra, query_valid, keep, keep_raw = self._prepare_query(n, q, intra_mask, store_len, store_valid,
                                                                 logits_to_keep)
        inputs, stored = self._layout(input_ids, position_ids, intra, store_len, store_valid, width, lengths)
        self.cache.set_write_columns(inputs[3], prefix)
        raw = self._call_model(*inputs, call=self.model, kept=kept, prefix=prefix)[:, kept - keep_raw:]
        lengths = lengths + stored
        if self.alignment == "position":
            logits = raw[:, -keep:]
        else:
            if carry is None or (store_len and not return_carry):
                raise ValueError("StaticModelRunner.step_forward: a right-shifted model's step needs `carry` (the "
                                 "logits of each row's last stored token, (R, V)), and `return_carry=True` when it "
                                 f"stores tokens (store_len={store_len}): the stored tokens change the carry.")
            logits, carry = align_right_shift(raw, query_valid, q, keep, store_len, carry)
        return (logits, lengths, carry) if return_carry else (logits, lengths)

    def _plain_offsets(self, width: int, front: int) -> torch.Tensor:
        """`(1, W)` int64 write offsets of a query without stored padding: its `q = W - front` tokens at `[0, q)`
        in order, then its front padding at `[q, W)` (cached per `(W, front)`; not inside a compiled step, whose
        guards would see the cache change)."""
        if recording_step():
            return ((torch.arange(width, device=self.device) - front) % width)[None]
        key = (width, front)
        if key not in self._offsets:
            self._offsets[key] = ((torch.arange(width, device=self.device) - front) % width)[None]
        return self._offsets[key]

    def _ensure_length(self, width: int) -> None:
        """Make room for `width` more columns after the longest row: sync the exact bound, grow if still short
        (doubling; the graphs captured against the old buffers go)."""
        if self._bound + width <= self.cache.max_cache_len:
            return
        self._bound = int(self.lengths.max()) if self.batch_size else 0
        self._grow_to(self._bound + width)

    def _grow_to(self, need: int) -> None:
        """Reallocate the cache with at least `need` columns when it has fewer (doubling; the graphs and compiled
        steps made against the old buffers go)."""
        if need > self.cache.max_cache_len:
            self.cache.grow(_round_up(max(need, 2 * self.cache.max_cache_len), LENGTH_GRANULE))
            self._state.reallocated()

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

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (continuous batching) at the next slots of the static buffers, which double
        their rows when full (new addresses: the graphs captured against the old buffers go)."""
        if count <= 0:
            return
        need = self.batch_size + count
        if need > self.cache.batch_capacity:
            self.cache.grow_rows(1 << (need - 1).bit_length())
            self._state.reallocated()
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])
        if self.carry is not None:
            self.carry = torch.cat([self.carry, self.carry.new_zeros(count, self.carry.shape[1])])

    def _absorb(self, first: int, temp: ModelRunner) -> None:
        """Move what the eager runner `temp` stored for rows `first ..` (their prompts, left-padded) into their
        slots: each row's real columns at its columns `[0, n)`, its write position n (no host read)."""
        width = temp.stored_len
        self._grow_to(width)
        stored = temp.valid.sum(dim=1)                                                    # (k,)
        order = (torch.arange(width, device=stored.device)[None] + (width - stored)[:, None]) % width  # real first
        for layer, joined in zip(self.cache.layers, temp.cache.layers):
            if getattr(joined, "keys", None) is None or joined.keys.numel() == 0:
                continue
            layer.allocate(joined.keys, joined.values, rows=self.batch_size)
            index = order.to(layer.keys.device)[:, None, :, None]
            for name, source in (("keys", joined.keys), ("values", joined.values)):
                moved = source.gather(2, index.expand(-1, source.shape[1], -1, source.shape[-1]))
                getattr(layer, name)[first:self.batch_size, :, :width] = moved
        self.lengths[first:] = stored.to(self.lengths.device)
        self._bound = max(self._bound, width)


def compiled_forward(runner: StaticModelRunner, kept: int, prefix: int, ids: torch.Tensor, pos: torch.Tensor,
                     wide: torch.Tensor, columns: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The static runtime's plain forward as a function of tensors, what `compile_config` compiles per shape
    (:meth:`StaticModelRunner._run`): bind the write columns, then the model call; `(rows, kept, V)` float32."""
    runner.cache.set_write_columns(columns, prefix)
    return runner._call_model(ids, pos, wide, columns, lengths, call=runner.model, kept=kept, prefix=prefix)


def _pad_rows(inputs: tuple, rows: int) -> tuple:
    """`(ids, pos, wide, columns, lengths)` of n rows padded to `rows`: each extra row is one query of ids 0 at
    positions 0 that sees only itself, written at columns `[0, W)` of an unused row of the buffers."""
    ids, pos, wide, columns, lengths = inputs
    extra, width = rows - ids.shape[0], ids.shape[1]
    if extra <= 0:
        return inputs
    device = ids.device
    own = torch.eye(width, dtype=torch.bool, device=device).expand(extra, width, width)
    return (torch.cat([ids, ids.new_zeros(extra, width)]), torch.cat([pos, pos.new_zeros(extra, width)]),
            torch.cat([wide.expand(ids.shape[0], width, width), own]),
            torch.cat([columns, torch.arange(width, device=device).expand(extra, width)]),
            torch.cat([lengths, lengths.new_zeros(extra)]))


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
    if isinstance(cache, StaticCache) and prepared_by_generate(cache):
        pop_cache(model_kwargs)


def _autocast_of(device: torch.device) -> str:
    """":autocast <dtype>" while `torch.autocast` is on for `device`'s type, else "": part of a kept state's key,
    since autocast changes the dtype of the K/V the cache holds (a plain call and an autocast call each keep their
    own state, as they would their own eager caches)."""
    kind = device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return ""
    return f":autocast {torch.get_autocast_dtype(kind)}"


@functools.lru_cache(maxsize=None)
def _warn_not_compiled(model_class: str, reason: str) -> None:
    """Say once per process and (model class, reason) that a `compile_config` does not compile, as transformers'
    own warning for it (`logger.warning_once`): a loop of calls repeats the same words otherwise."""
    logger.warning("hf_dllm_spec: `compile_config` is set but %s is not compiled: %s.", model_class, reason)


def make_runner(model, patch, stats: BatchStats, *, batch_size: int, generation_config: GenerationConfig,
                max_cache_len: int, use_cache: bool = True, cache=None, timer: ForwardTimer | None = None,
                timer_span: str | None = None) -> ModelRunner:
    """The runner `generate` uses for `model`: :class:`StaticModelRunner` when
    `generation_config.cache_implementation == "static"`, else the eager :class:`ModelRunner`.

    Args:
        max_cache_len (`int`): static runtime: columns per row to allocate (a longer need reallocates);
            `generation_config.max_cache_len` (transformers' ceiling for the calls to come), when larger, sizes it.
        use_cache, cache: eager runner only (the checks refuse a cache or `use_cache=False` with "static").
        Others: as the runners'.
    """
    if generation_config.cache_implementation != "static":
        return ModelRunner(model, patch, stats, batch_size=batch_size, use_cache=use_cache, cache=cache, timer=timer,
                           timer_span=timer_span)
    mode, reason = compile_plan(model, generation_config)
    if reason and generation_config.compile_config is not None and not generation_config.disable_compile:
        _warn_not_compiled(type(model).__name__, reason)
    max_cache_len = max(max_cache_len, getattr(generation_config, "max_cache_len", None) or 0)
    return StaticModelRunner(model, patch, stats, batch_size=batch_size, max_cache_len=max_cache_len,
                             compile_mode=mode, compile_config=generation_config.compile_config,
                             compile_reason=reason, timer=timer, timer_span=timer_span)


__all__ = ["RowStaticCache", "RowStaticLayer", "StaticModelRunner", "clear_static_state", "compile_plan",
           "configure_static_runtime", "drop_prepared_static_cache", "hold_static_runtime", "make_runner",
           "prefix_bucket", "rows_bucket", "static_cache_length", "static_states", "width_bucket"]
