"""Training objectives of the one training recipe (`recipes.train`), one class per objective.

An objective builds (or converts) the model, computes the loss of one batch and saves the result in its
family's Hub layout. All share the data (`recipes.data`, `recipes.arithmetic`), the tokenizer, the optimiser,
the schedule, the resumable loop and the training log of `recipes.train`.

- ``ar``: next-token cross-entropy (a Qwen2 causal LM: the AR baseline, DEER's target).
- ``block_diffusion``: SDAR's objective (SDAR, arXiv 2510.06303): `[noisy | clean]` with shared positions and
  the block-diffusion mask, one t per sequence, loss 1/t on masked positions (position-aligned).
- ``d2a``: DEER's drafter alignment (arXiv 2512.15176 §3.1) of a block-diffusion drafter to an AR teacher, on
  the teacher's own continuations; Stage I (``--d2a-stage 1``, Eq. 1-2) and Stage II (``--d2a-stage 2``,
  Eq. 3-4). See :class:`D2AObjective`.
- ``fast_dllm_v2``: Fast-dLLM v2's conversion of an AR model (arXiv 2509.26328 §3): the same layout, one t per
  block of `bd_size`, every sample duplicated with the complementary mask, and the causal-LM loss (logits at
  i - 1 predict token i) on masked positions of the noisy copy: the model stays right-shifted.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import ClassVar

import torch
from tqdm import tqdm

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
FAST_DLLM_MASK = "|<MASK>|"


def bd_training_mask(seq_len: int, block_size: int) -> torch.Tensor:
    """Block-diffusion training mask over `[noisy | clean]`, `(2L, 2L)` bool, True = attend (SDAR, BD3-LM).

    A noisy block sees itself and strictly earlier clean blocks; the clean copy is block-causal.
    """
    blk = torch.arange(seq_len) // block_size
    same = blk[:, None] == blk[None, :]
    earlier = blk[None, :] < blk[:, None]
    causal_blocks = blk[None, :] <= blk[:, None]
    top = torch.cat([same, earlier], dim=1)                             # noisy rows
    bottom = torch.cat([torch.zeros_like(same), causal_blocks], dim=1)  # clean rows
    return torch.cat([top, bottom], dim=0)


def packed_windows_mask(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`base` (the `(1, 1, 2L, 2L)` mask of :func:`bd_training_mask`) for each packed window of `x` `(b, L)`: a
    noisy row no longer sees the noisy copy of a later document in its block (a document ends with its EOS), whose
    clean question would tell it where its answer ends; at inference the positions after an answer are masks.
    Returns `(b, 1, 2L, 2L)` bool."""
    seq_len = x.shape[1]
    eos = (x == EOS_ID).long()
    document = eos.cumsum(dim=1) - eos                                    # (b, L), an EOS closes its document
    later = document[:, None, :] > document[:, :, None]                  # (b, L, L): j in a later document than i
    mask = base.expand(x.shape[0], -1, -1, -1).clone()
    mask[:, 0, :seq_len, :seq_len] &= ~later
    return mask


def small_qwen_kwargs(args, vocab_size: int) -> dict:
    """Shared architecture of the bundled models (4 heads / 2 KV heads, MLP 3x, tied, RoPE 1e4, 2,048 positions)."""
    return dict(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, rope_theta=10_000.0, tie_word_embeddings=True,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None)


class Objective:
    """One training objective. `name` is the `--objective` value; `mask_id` the token the loss masks with."""

    name: ClassVar[str]
    block_sizes: ClassVar[dict[int, float]] = {}
    #: The `model_type`s a `--init-from` checkpoint may have (what `build_model` loads it as).
    init_types: ClassVar[tuple[str, ...]] = ()
    #: Whether the objective starts from a checkpoint (a conversion, an alignment).
    init_required: ClassVar[bool] = False
    #: The `model_type`s of `--teacher` (an objective with a teacher).
    teacher_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, args) -> None:
        self.args = args
        self._mask_cache: dict = {}

    def prepare_tokenizer(self, tokenizer):
        """Adapt the tokenizer for this objective (default: unchanged)."""
        return tokenizer

    def build_model(self, args, tokenizer, init_from: str | None):
        raise NotImplementedError

    def loss(self, model, x: torch.Tensor, maskable: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def save(self, model, tokenizer, out: pathlib.Path) -> None:
        """Save in bf16 with the tokenizer and a generation config whose eos list is `[EOS_ID]`."""
        model.eval()
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        model.generation_config.eos_token_id = [EOS_ID]
        model.generation_config.pad_token_id = PAD_ID
        model.generation_config.save_pretrained(out)

    def block_mask(self, seq_len: int, block_size: int) -> torch.Tensor:
        """`bd_training_mask(seq_len, block_size)` as `(1, 1, 2L, 2L)`, kept per `(seq_len, block_size)`."""
        if (seq_len, block_size) not in self._mask_cache:
            self._mask_cache[seq_len, block_size] = bd_training_mask(seq_len, block_size)[None, None]
        return self._mask_cache[seq_len, block_size]

    def record(self) -> dict:
        """Objective-specific entries of the stage's training log."""
        return {}

    def build_streams(self, tokenizer, code_texts: list[str], problems: list[dict], default):
        """The token streams to train on; `default(tokenizer, code_texts, problems)` builds the shared ones."""
        return default(tokenizer, code_texts, problems)


class AutoregressiveObjective(Objective):
    """Next-token cross-entropy on maskable targets (answers and code; questions are context only)."""

    name = "ar"
    init_types = ("qwen2",)

    def __init__(self, args) -> None:
        super().__init__(args)
        if getattr(args, "seq_len", 2) < 2:
            raise ValueError(f"--seq-len (={args.seq_len}) must be >= 2 for --objective ar (a window of one token has "
                             "no next token to learn): pass e.g. --seq-len 256")

    def build_model(self, args, tokenizer, init_from):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        if init_from:
            return Qwen2ForCausalLM.from_pretrained(init_from, dtype=torch.float32, attn_implementation="sdpa")
        config = Qwen2Config(**small_qwen_kwargs(args, len(tokenizer)), attn_implementation="sdpa")
        return Qwen2ForCausalLM(config)

    def loss(self, model, x, maskable, gen):
        """Mean cross-entropy over the batch's targets; 0 for a batch without any (a short window of question
        tokens only: the mean over no targets was NaN, and the logged loss stayed NaN from then on)."""
        logits = model(input_ids=x).logits[:, :-1].float()
        labels = x[:, 1:].masked_fill(~maskable[:, 1:], -100)
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                  ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum().clamp_min(1)


class BlockDiffusionObjective(Objective):
    """SDAR's block-diffusion objective; the block size is drawn per step from `block_sizes`."""

    name = "block_diffusion"
    init_types = ("sdar",)
    #: 4 (the trained block size, written to the config) most of the time; 1 keeps the AR mode S2D2 verifies
    #: with on-distribution, 16 keeps larger blocks usable (a deviation from SDAR, see the model card).
    block_sizes = {4: 0.6, 1: 0.2, 16: 0.2}

    def build_model(self, args, tokenizer, init_from):
        from model_patches.sdar import SDARConfig, SDARForCausalLM

        if init_from:
            return SDARForCausalLM.from_pretrained(init_from, dtype=torch.float32, attn_implementation="sdpa")
        config = SDARConfig(**small_qwen_kwargs(args, len(tokenizer)), head_dim=args.hidden // 4, block_size=4,
                            mask_token_id=MASK_ID, attn_implementation="sdpa")
        return SDARForCausalLM(config)

    def loss(self, model, x, maskable, gen):
        t, noise, noisy = self.mask_noise(x, maskable, gen)
        hidden = self.noisy_hidden(model, noisy, x, gen)
        return self.masked_loss(model, hidden, x, noise, t, maskable)

    def mask_noise(self, x, maskable, gen):
        """One t ~ U(1e-3, 1) per sequence; each maskable position masked with probability t.
        Returns `(t (b,), noise (b, L) bool, noisy (b, L))`."""
        b, seq_len = x.shape
        t = torch.rand(b, generator=gen) * (1 - 1e-3) + 1e-3                         # (b,)
        noise = (torch.rand(b, seq_len, generator=gen) < t[:, None]) & maskable       # (b, L)
        return t, noise, torch.where(noise, torch.full_like(x, MASK_ID), x)

    def noisy_hidden(self, model, noisy, x, gen):
        """Hidden states of the noisy half of `[noisy | clean]` (shared positions, block-diffusion mask, a block
        size drawn from `block_sizes`), `(b, L, H)`."""
        sizes = list(self.block_sizes)
        block_size = sizes[int(torch.multinomial(torch.tensor(list(self.block_sizes.values())), 1, generator=gen))]
        b, seq_len = x.shape
        pos = torch.arange(seq_len).repeat(2)[None].expand(b, -1)
        hidden = model.model(input_ids=torch.cat([noisy, x], dim=1), position_ids=pos,
                             attention_mask=packed_windows_mask(self.block_mask(seq_len, block_size), x)
                             ).last_hidden_state
        return hidden[:, :seq_len]

    @staticmethod
    def masked_loss(model, hidden, x, noise, t, maskable):
        """Mask-to-token loss: cross-entropy at masked positions weighted 1/t, over the maskable count."""
        logits = model.lm_head(hidden[noise]).float()                                 # (N, V)
        token_loss = torch.nn.functional.cross_entropy(logits, x[noise], reduction="none")
        weights = (1.0 / t)[:, None].expand_as(noise)[noise]
        return (token_loss * weights).sum() / maskable.sum().clamp_min(1)

    def record(self):
        return {"block_size_mix": self.block_sizes}


class FastDLLMV2Objective(Objective):
    """Fast-dLLM v2 conversion of an AR Qwen2 model: complementary masks, per-block t, right-shifted loss.

    The tokenizer gains the Hub mask token `|<MASK>|` as an additional special token (its `mask_token` stays
    unset, as on the Hub) and the embedding grows to a multiple of 64 rows (rows above the tokenizer, as on
    the Hub); the new rows start at the mean embedding.
    """

    name = "fast_dllm_v2"
    init_types, init_required = ("qwen2", "Fast_dLLM_Qwen"), True

    def prepare_tokenizer(self, tokenizer):
        if FAST_DLLM_MASK not in tokenizer.get_vocab():
            tokenizer.add_special_tokens({"additional_special_tokens": [FAST_DLLM_MASK]})
        tokenizer.mask_token = None
        self.mask_id = tokenizer.convert_tokens_to_ids(FAST_DLLM_MASK)
        return tokenizer

    def build_model(self, args, tokenizer, init_from):
        from transformers import Qwen2ForCausalLM

        from model_patches.fast_dllm_v2 import Fast_dLLM_QwenConfig, Fast_dLLM_QwenForCausalLM

        if not init_from:
            raise ValueError("`--init-from` (=None) is required for --objective fast_dllm_v2: the conversion starts "
                             "from an AR Qwen2 checkpoint, e.g. --init-from models/qwen2-tiny-ar.")
        if json.loads((pathlib.Path(init_from) / "config.json").read_text())["model_type"] == "Fast_dLLM_Qwen":
            model = Fast_dLLM_QwenForCausalLM.from_pretrained(init_from, dtype=torch.float32,
                                                              attn_implementation="sdpa")
            model.config.bd_size = self.args.bd_size      # the block size this stage trains (the decoding default)
            return model
        ar = Qwen2ForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        fields = {k: v for k, v in ar.config.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version", "dtype")}
        rows = -(-len(tokenizer) // 64) * 64
        fields.update(vocab_size=rows, bd_size=args.bd_size, conplemenrary_mask=True,
                      architectures=["Fast_dLLM_QwenForCausalLM"])
        model = Fast_dLLM_QwenForCausalLM(Fast_dLLM_QwenConfig(**fields, attn_implementation="sdpa"))
        state = ar.state_dict()
        old = state["model.embed_tokens.weight"]
        grown = old.mean(dim=0, keepdim=True).expand(rows - old.shape[0], -1)
        state["model.embed_tokens.weight"] = torch.cat([old, grown], dim=0)
        state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=False)
        model.tie_weights()
        return model

    def loss(self, model, x, maskable, gen):
        bd = self.args.bd_size
        b, seq_len = x.shape
        blocks = seq_len // bd
        t = torch.rand(b, blocks, generator=gen) * (1 - 1e-3) + 1e-3                  # one t per block
        draw = torch.rand(b, seq_len, generator=gen) < t.repeat_interleave(bd, dim=1)
        noise = torch.cat([draw, ~draw]) & maskable.repeat(2, 1)                      # complementary copy
        clean = x.repeat(2, 1)
        noisy = torch.where(noise, torch.full_like(clean, self.mask_id), clean)
        pos = torch.arange(seq_len).repeat(2)[None].expand(2 * b, -1)
        hidden = model.model(input_ids=torch.cat([noisy, clean], dim=1), position_ids=pos,
                             attention_mask=packed_windows_mask(self.block_mask(seq_len, bd), clean)
                             ).last_hidden_state
        target = noise[:, 1:]                                                         # row i - 1 predicts i
        logits = model.lm_head(hidden[:, : seq_len - 1][target]).float()              # (N, V)
        return torch.nn.functional.cross_entropy(logits, clean[:, 1:][target])

    def record(self):
        return {"bd_size": self.args.bd_size, "complementary_mask": True, "mask_token_id": self.mask_id}


def d2a_training_mask(segment: torch.Tensor) -> torch.Tensor:
    """D2A training mask over `[noisy | clean]`, `(b, 2L, 2L)` bool, True = attend.

    The drafter's inference layout (`hf_dllm_spec.strategies.drafting`, "causal_prefix"): the clean copy is token-causal
    (the verified prefix); a noisy segment sees itself in full and the clean tokens strictly before it.

    Args:
        segment (`torch.Tensor` of shape `(b, L)`, int64): non-decreasing segment index of each position.
    """
    same = segment[:, :, None] == segment[:, None, :]
    before = segment[:, None, :] < segment[:, :, None]
    causal = torch.ones(segment.shape[1], segment.shape[1], dtype=torch.bool).tril()[None].expand_as(same)
    top = torch.cat([same, before], dim=2)
    bottom = torch.cat([torch.zeros_like(same), causal], dim=2)
    return torch.cat([top, bottom], dim=1)


def random_segments(b: int, seq_len: int, max_len: int, gen: torch.Generator, fixed: int | None = None) -> torch.Tensor:
    """Segment index per position, `(b, L)`: segments of `fixed` tokens at a random offset, or of random
    lengths in [1, max_len] (random truncation points: each segment start is a continuation boundary)."""
    if fixed is not None:
        offset = torch.randint(0, fixed, (b, 1), generator=gen)
        return (torch.arange(seq_len)[None] + offset) // fixed
    lengths = torch.randint(1, max_len + 1, (b, seq_len), generator=gen)
    starts = torch.zeros(b, seq_len, dtype=torch.bool)
    for row in range(b):
        i = 0
        for length in lengths[row].tolist():
            if i >= seq_len:
                break
            starts[row, i] = True
            i += length
    return starts.long().cumsum(dim=1) - 1


def cut_at_continuation_edges(segment: torch.Tensor, maskable: torch.Tensor) -> torch.Tensor:
    """`segment` re-cut wherever a continuation starts or ends, `(b, L)` int64: a segment never holds prompt and
    continuation tokens together, so masked continuation tokens see only their own segment and the clean copy
    before it (the drafter's inference layout, DEER Eq. 1-4: one answer's prefix and its masked suffix), never the
    next example's prompt in a packed window (which tells where the answer ends).

    Args:
        segment (`torch.Tensor` of shape `(b, L)`, int64): non-decreasing segment index of each position.
        maskable (`torch.Tensor` of shape `(b, L)`, bool): continuation tokens (prompts are context only).
    """
    starts = torch.ones_like(maskable)
    starts[:, 1:] = (segment[:, 1:] != segment[:, :-1]) | (maskable[:, 1:] != maskable[:, :-1])
    return starts.long().cumsum(dim=1) - 1


class D2AObjective(BlockDiffusionObjective):
    """DEER's two-stage drafter alignment (D2A, arXiv 2512.15176 §3.1, Eq. 1-4; `strategies.md` §7.2).

    Data: the teacher (`--teacher`, an AR model of the same tokenizer, e.g. models/qwen2-tiny-ar) continues
    every training prompt greedily: arithmetic questions, and windows of standard-library code; the drafter
    learns the teacher's continuations (question / code-prefix tokens are context only). A window of the
    stream is cut into segments, and again wherever a continuation starts or ends
    (:func:`cut_at_continuation_edges`); each segment start is a truncation point whose past is the clean, causal
    prefix (`[noisy | clean]` layout, :func:`d2a_training_mask`, as the drafter attends at inference).

    - Stage I (`--d2a-stage 1`, AR-style continuation distillation, Eq. 1-2): segments of k in {4, 8, 16, 32}
      (the draft block sizes) at a random offset; one t ~ U(1e-3, 1) per sequence (Eq. 1's U(0, 1], kept away
      from 0, where 1/t explodes) masks continuation tokens, loss (1/t) x cross-entropy on masked tokens.
    - Stage II (`--d2a-stage 2`, prefix-conditioned refinement, Eq. 3-4): segments of R ~ U(1, R_max) tokens
      (`--d2a-max-refine`, 96 in the paper), every continuation token masked (t = 1, as at inference), token i
      of a segment (1-based) weighted alpha^(R - i) (`--d2a-alpha`, 1.01): tokens nearest the prefix weigh
      most.
    - SEP (`--d2a-sep-token-id`): refused (the packed layout inserts no SEP token; the drafter's inference layout
      would append it after the masks, `hf_dllm_spec.strategies.drafting.draft_block_layout`). The bundled
      drafter has none (the tokenizer has no spare special token, and the masks already mark the boundary).
    """

    name = "d2a"
    init_required, teacher_types = True, ("qwen2",)
    block_sizes = {4: 0.25, 8: 0.25, 16: 0.25, 32: 0.25}

    def __init__(self, args) -> None:
        super().__init__(args)
        if getattr(args, "d2a_sep_token_id", None) is not None:
            raise NotImplementedError("--d2a-sep-token-id: the packed layout does not insert SEP tokens yet; "
                                      "train without SEP (the default).")
        alpha, refine = getattr(args, "d2a_alpha", 1.01), getattr(args, "d2a_max_refine", 96)
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"--d2a-alpha (={alpha}) must be > 0 (the weights alpha^(R - i) of DEER Eq. 3; a "
                             "negative base alternates their sign): pass e.g. 1.01 (the paper uses 1.01-1.05).")
        if refine < 1:
            raise ValueError(f"--d2a-max-refine (={refine}) must be >= 1 (R ~ U(1, R_max)): pass e.g. 96.")
        if hasattr(args, "teacher") and args.teacher is None:
            raise ValueError("--teacher (=None) is required for --objective d2a (the AR model whose continuations "
                             "the drafter learns; a --d2a-teacher-cache is reused only with the teacher it records): "
                             "pass e.g. --teacher models/qwen2-tiny-ar.")

    def _teacher_settings(self) -> dict:
        """What the teacher's continuations depend on, kept in `--d2a-teacher-cache` and checked on reuse."""
        args = self.args
        return {"teacher": args.teacher, "seed": args.seed, "teacher_problems": args.d2a_teacher_problems,
                "teacher_code_windows": args.d2a_teacher_code, "max_operand": args.max_operand,
                "train_problems": args.train_problems}

    def build_model(self, args, tokenizer, init_from):
        if not init_from:
            raise ValueError("`--init-from` (=None) is required for --objective d2a: alignment starts from a "
                             "diffusion drafter, e.g. --init-from models/sdar-tiny-arith.")
        return super().build_model(args, tokenizer, init_from)

    def build_streams(self, tokenizer, code_texts, problems, default):
        from .arithmetic import format_prompt

        args = self.args
        cache = pathlib.Path(args.d2a_teacher_cache) if getattr(args, "d2a_teacher_cache", None) else None
        if cache is not None and cache.exists():
            saved = torch.load(cache)
            settings, current = saved.pop("settings", None), self._teacher_settings()
            if settings != current:
                differ = sorted(k for k in current if (settings or {}).get(k) != current[k])
                raise ValueError(f"--d2a-teacher-cache {cache} was written with other settings ({settings}; differ: "
                                 f"{', '.join(differ)}): pass the same --teacher, --seed, --d2a-teacher-problems, "
                                 "--d2a-teacher-code, --max-operand and --train-problems as when it was written, or "
                                 "another file (delete it to rebuild).")
            self.teacher_tokens = {name: int(m.sum()) for name, (_, m) in saved.items()}
            return saved
        prompts = tokenizer([format_prompt(p["question"]) for p in problems[: args.d2a_teacher_problems]],
                            add_special_tokens=False)["input_ids"]
        gen = torch.Generator().manual_seed(args.seed)
        code_stream = torch.tensor([t for ids in tokenizer(code_texts, add_special_tokens=False)["input_ids"]
                                    for t in ids + [EOS_ID]])
        starts = torch.randint(0, code_stream.shape[0] - 64, (args.d2a_teacher_code,), generator=gen).tolist()
        code_prompts = [code_stream[i:i + 48].tolist() for i in starts]
        from transformers import Qwen2ForCausalLM

        teacher = Qwen2ForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
        arith = teacher_stream(teacher, prompts, max_new_tokens=48)
        code = teacher_stream(teacher, code_prompts, max_new_tokens=64)
        self.teacher_tokens = {"arith": int(arith[1].sum()), "code": int(code[1].sum())}
        if cache is not None:
            torch.save({"arith": arith, "code": code, "settings": self._teacher_settings()}, cache)
        return {"arith": arith, "code": code}


    def loss(self, model, x, maskable, gen):
        args = self.args
        b, seq_len = x.shape
        if args.d2a_stage == 1:
            sizes = list(self.block_sizes)
            k = sizes[int(torch.multinomial(torch.tensor(list(self.block_sizes.values())), 1, generator=gen))]
            segment = cut_at_continuation_edges(random_segments(b, seq_len, k, gen, fixed=k), maskable)
            t = torch.rand(b, generator=gen) * (1 - 1e-3) + 1e-3
            noise = (torch.rand(b, seq_len, generator=gen) < t[:, None]) & maskable
            weights = (1.0 / t)[:, None].expand(b, seq_len)
        else:
            segment = cut_at_continuation_edges(random_segments(b, seq_len, args.d2a_max_refine, gen), maskable)
            noise = maskable.clone()
            starts = torch.cat([torch.ones(b, 1, dtype=torch.bool), segment[:, 1:] != segment[:, :-1]], dim=1)
            index = torch.arange(seq_len)[None].expand(b, -1)
            first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values    # segment start
            length = torch.zeros(b, int(segment.max()) + 1, dtype=torch.long).scatter_add_(
                1, segment, torch.ones_like(segment)).gather(1, segment)                         # R
            i = index - first + 1                                                                # 1-based
            weights = torch.tensor(args.d2a_alpha).pow((length - i).float())
        noisy = torch.where(noise, torch.full_like(x, MASK_ID), x)
        pos = torch.arange(seq_len).repeat(2)[None].expand(b, -1)
        hidden = model.model(input_ids=torch.cat([noisy, x], dim=1), position_ids=pos,
                             attention_mask=d2a_training_mask(segment)[:, None]).last_hidden_state
        logits = model.lm_head(hidden[:, :seq_len][noise]).float()
        token_loss = torch.nn.functional.cross_entropy(logits, x[noise], reduction="none")
        return (token_loss * weights[noise]).sum() / maskable.sum().clamp_min(1)

    def record(self):
        args = self.args
        out = {"d2a_stage": args.d2a_stage, "teacher": args.teacher, "teacher_tokens": self.teacher_tokens,
               "teacher_problems": args.d2a_teacher_problems, "teacher_code_windows": args.d2a_teacher_code}
        if args.d2a_stage == 1:
            out["block_size_mix"] = self.block_sizes
        else:
            out.update(max_refine=args.d2a_max_refine, alpha=args.d2a_alpha)
        return out


def teacher_stream(teacher, prompts: list[list[int]], max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[prompt | teacher's greedy continuation (up to its EOS)]` concatenated; continuations are maskable."""
    ids, maskable = [], []
    batch = 256
    for start in tqdm(range(0, len(prompts), batch), desc="teacher continuations", mininterval=10):
        rows = prompts[start:start + batch]
        width = max(len(r) for r in rows)
        x = torch.tensor([[PAD_ID] * (width - len(r)) + r for r in rows])
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = teacher.generate(input_ids=x, attention_mask=attention, max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        for r, new in zip(rows, out[:, width:].tolist()):
            continuation = new[: new.index(EOS_ID) + 1] if EOS_ID in new else new
            ids += r + continuation
            maskable += [False] * len(r) + [True] * len(continuation)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(maskable, dtype=torch.bool)


class LLaDA2Objective(BlockDiffusionObjective):
    """LLaDA2.1's objectives on a small LLaDA2 MoE (Hub layout): block-diffusion mask-to-token (M2T) plus
    token-to-token editing (T2T; LLaDA2.1 tech report §2).

    The noisy half of `[noisy | clean]` is masked as for SDAR; then a share r ~ U(0, `edit_max_rate`) of the
    positions left visible (per sequence) is replaced by random tokens. Loss = the M2T loss (1/t weighted, masked
    positions) + the T2T loss: cross-entropy of the clean token at every visible maskable position of the noisy
    half (corrupted ones learn the correction, the others to keep their token), over the maskable count. The
    block size mix (`block_sizes`: 32 half the time, 16, 4 and 1) holds 32 (LLaDA2's trained block size) and 1
    (the AR mode S2D2 verifies with). `--init-from` an SDAR checkpoint upcycles it first, function-preserving
    (`recipes.upcycle`); without it the model starts from scratch (8 experts in 2 groups, top-2 of 1 group, one
    shared expert).
    """

    name = "llada2"
    init_types = ("sdar", "llada2_moe")
    block_sizes = {32: 0.5, 16: 0.1, 4: 0.2, 1: 0.2}
    edit_max_rate = 0.25
    upcycled_from: str | None = None          # the SDAR checkpoint `build_model` upcycled, recorded in the log

    def build_model(self, args, tokenizer, init_from):
        from model_patches.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
        from model_patches.sdar import SDARForCausalLM

        from .upcycle import sdar_to_llada2

        source_type = json.loads((pathlib.Path(init_from) / "config.json").read_text())["model_type"] if init_from else None
        if source_type == "sdar":                                        # upcycle a trained SDAR model
            self.upcycled_from = init_from
            sdar = SDARForCausalLM.from_pretrained(init_from, dtype=torch.float32, attn_implementation="sdpa")
            return sdar_to_llada2(sdar, moe_intermediate_size=args.hidden // 2, num_shared_experts=2)
        if init_from:
            return LLaDA2MoeModelLM.from_pretrained(init_from, dtype=torch.float32, attn_implementation="sdpa")
        base = {**small_qwen_kwargs(args, len(tokenizer)), "tie_word_embeddings": False}    # untied, as the Hub
        base.pop("bos_token_id")
        config = LLaDA2MoeConfig(**base, head_dim=args.hidden // 4, partial_rotary_factor=0.5,
                                 num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, num_shared_experts=1,
                                 moe_intermediate_size=args.hidden // 2, first_k_dense_replace=1,
                                 routed_scaling_factor=2.5, initializer_range=0.02, block_size=32,
                                 mask_token_id=MASK_ID, attn_implementation="sdpa")
        return LLaDA2MoeModelLM(config)

    def loss(self, model, x, maskable, gen):
        t, noise, noisy = self.mask_noise(x, maskable, gen)
        visible = maskable & ~noise
        rate = torch.rand(x.shape[0], generator=gen) * self.edit_max_rate                  # (b,)
        corrupt = visible & (torch.rand(x.shape, generator=gen) < rate[:, None])
        random_tokens = torch.randint(len(SPECIALS), model.config.vocab_size, x.shape, generator=gen)
        noisy = torch.where(corrupt, random_tokens, noisy)
        hidden = self.noisy_hidden(model, noisy, x, gen)
        m2t = self.masked_loss(model, hidden, x, noise, t, maskable)
        logits = model.lm_head(hidden[visible]).float()
        t2t = torch.nn.functional.cross_entropy(logits, x[visible], reduction="sum") / maskable.sum().clamp_min(1)
        return m2t + t2t

    def record(self):
        return {"block_size_mix": self.block_sizes, "edit_max_rate": self.edit_max_rate,
                "loss": "M2T (1/t weighted) + T2T (visible positions, random-token corruption)",
                "upcycled_from": self.upcycled_from}


OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (AutoregressiveObjective, BlockDiffusionObjective, FastDLLMV2Objective, D2AObjective,
                              LLaDA2Objective)
}


def read_stages(init_from: str | None) -> list:
    """The stages recorded in `init_from`'s `training_log.json` (empty without one)."""
    if not init_from:
        return []
    log = pathlib.Path(init_from) / "training_log.json"
    if not log.exists():
        return []
    previous = json.loads(log.read_text())
    return previous.get("stages", [previous])
