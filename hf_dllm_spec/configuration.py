"""Validated strategy configurations that round-trip through `generation_config.json`.

One dataclass per `decoding_strategy`; parameter names and defaults follow shared/reference/strategies.md
(the S2D2 names are those of the reference code, so its command lines port one to one). A config validates
when built and again inside `generate` after the call's overrides are merged.

Round trip: :meth:`DecodingConfig.save_to_generation_config` writes a ``dllm_decoding`` dict (strategy name
plus every parameter) into a `GenerationConfig`; `generate(decoding_strategy=X)` reads it back as the
defaults for strategy X. A ``dllm_decoding`` entry never selects a strategy on its own: without
`decoding_strategy` the stock `generate` runs unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, ClassVar

from transformers import GenerationConfig

from .routing import ESTIMATORS, POLICIES, SCORE_TYPES, UCB_ENTROPY_SOURCES
from .unmasking import REMASKING_STRATEGIES
from .validation import check_choice, check_range, invalid

GENERATION_CONFIG_KEY = "dllm_decoding"


class DecodingStrategyName(str, Enum):
    """Values of `generate(decoding_strategy=...)`."""

    AR = "ar"
    BLOCK_DIFFUSION = "block_diffusion"
    S2D2 = "s2d2"


def _check_int(name: str, value: Any, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(name, value, f"be an integer >= {low}", fix)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise invalid(name, value, "be a bool", "pass True or False")


@dataclass
class DecodingConfig:
    """Base of the strategy configs: validation, presets, dict and generation-config round trip."""

    decoding_strategy: ClassVar[str] = ""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first bad parameter, its value, the rule and the fix."""

    @classmethod
    def parameter_names(cls) -> tuple[str, ...]:
        """Names accepted by this strategy, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "DecodingConfig":
        """Build from keyword arguments, rejecting names this strategy does not have.

        Raises:
            ValueError: for an unknown parameter (listing the valid ones) or a bad value.
        """
        valid = cls.parameter_names()
        for name in kwargs:
            if name not in valid:
                raise invalid(
                    name, kwargs[name], f"be a parameter of decoding_strategy={cls.decoding_strategy!r}",
                    f"remove it, or use one of: {', '.join(valid)}",
                )
        return cls(**kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "DecodingConfig":
        """A named configuration from the paper (see `presets`), with optional overrides.

        Raises:
            ValueError: for an unknown preset name (listing the valid ones).
        """
        if name not in cls.presets:
            check_choice("preset", name, tuple(cls.presets) or ("<none>",),
                         f"use one of the presets of decoding_strategy={cls.decoding_strategy!r}")
        return cls.from_kwargs(**{**cls.presets[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Every parameter plus ``decoding_strategy``, JSON-serialisable."""
        return {"decoding_strategy": self.decoding_strategy, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DecodingConfig":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: if ``data["decoding_strategy"]`` names another strategy, or a parameter is bad.
        """
        data = dict(data)
        name = data.pop("decoding_strategy", cls.decoding_strategy)
        if name != cls.decoding_strategy:
            raise invalid("decoding_strategy", name, f"be {cls.decoding_strategy!r} for {cls.__name__}",
                          f"load it with the config class of {name!r}")
        return cls.from_kwargs(**data)

    def save_to_generation_config(self, generation_config: GenerationConfig) -> GenerationConfig:
        """Store this config under ``generation_config.dllm_decoding``; `save_pretrained` then writes it."""
        setattr(generation_config, GENERATION_CONFIG_KEY, self.to_dict())
        return generation_config

    @classmethod
    def stored_defaults(cls, generation_config: GenerationConfig | None) -> dict[str, Any]:
        """Parameters stored for this strategy in a generation config (empty when none or another strategy)."""
        stored = getattr(generation_config, GENERATION_CONFIG_KEY, None) if generation_config is not None else None
        if not stored or stored.get("decoding_strategy") != cls.decoding_strategy:
            return {}
        return {k: v for k, v in stored.items() if k != "decoding_strategy"}


@dataclass
class BlockDiffusionConfig(DecodingConfig):
    """Block-diffusion decoding with confidence-based unmasking (S2D2 paper Algorithms 1-2).

    Args:
        block_size (`int`, *optional*): tokens per block, counted from absolute position 0. `None` uses the
            checkpoint's trained block size (`config.block_size`); other sizes run off-distribution with a
            warning.
        steps_per_block (`int`, *optional*): denoising steps S of the commit schedule; `None` = block_size
            (one token per step at least). Steps past S reuse the last schedule entry until the block is full.
        remasking_strategy (`str`, defaults to "low_confidence_dynamic"): commit rule, see `unmasking.py`.
        confidence_threshold (`float`, defaults to 0.85): tau of the dynamic rule, probability in (0, 1];
            1.0 gives static decoding.
        eb_threshold (`float`, defaults to 0.35): entropy budget in nats of `entropy_bounded`.
        cache_ver (`bool`, defaults to False): AR-like caching: prefill and block writes use a token-causal
            mask, so the cache equals what block size 1 would store (S2D2 §4.2).
        draft_ver (`bool`, defaults to False): partially causal drafting mask (S2D2 Eq. 4).
        fuse_cache_write (`bool`, defaults to True): write a finished block's K/V in the same forward as the
            next block's first denoising step (exact; saves one forward per block, so AR costs one forward per
            token). False reproduces the reference accounting: one separate write forward per finished block,
            the last one included.
    """

    decoding_strategy: ClassVar[str] = DecodingStrategyName.BLOCK_DIFFUSION.value

    block_size: int | None = None
    steps_per_block: int | None = None
    remasking_strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    eb_threshold: float = 0.35
    cache_ver: bool = False
    draft_ver: bool = False
    fuse_cache_write: bool = True

    def validate(self) -> None:
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1, "pass a positive number of tokens, e.g. 4")
        if self.steps_per_block is not None:
            _check_int("steps_per_block", self.steps_per_block, 1, "pass at least one denoising step per block")
            if self.block_size is not None and self.steps_per_block > self.block_size:
                raise invalid("steps_per_block", self.steps_per_block,
                              f"be at most `block_size` (={self.block_size})",
                              "use steps_per_block <= block_size (one token per step at least)")
        check_choice("remasking_strategy", self.remasking_strategy, REMASKING_STRATEGIES)
        check_range("confidence_threshold", self.confidence_threshold, low=0.0, high=1.0, low_open=True,
                    fix="pass a probability such as 0.85 (1.0 gives static decoding)")
        check_range("eb_threshold", self.eb_threshold, low=0.0, low_open=True,
                    fix="pass a positive entropy budget in nats, e.g. 0.35")
        for name in ("cache_ver", "draft_ver", "fuse_cache_write"):
            _check_bool(name, getattr(self, name))


@dataclass
class ARConfig(BlockDiffusionConfig):
    """Autoregressive decoding of a block-diffusion model: block size 1 (the S2D2 AR baseline).

    With `fuse_cache_write=True` each token costs one forward, like a real AR model.
    """

    decoding_strategy: ClassVar[str] = DecodingStrategyName.AR.value

    block_size: int | None = 1

    def validate(self) -> None:
        super().validate()
        if self.block_size != 1:
            raise invalid("block_size", self.block_size, "be 1 for decoding_strategy='ar'",
                          "drop `block_size`, or use decoding_strategy='block_diffusion' for larger blocks")


_SDAR_AR_CACHING = {"cache_ver": True, "draft_ver": True, "token_acceptance_estimator": "soft_entropy_negexp"}


@dataclass
class S2D2Config(BlockDiffusionConfig):
    """S2D2 self-speculative block diffusion (arXiv 2603.25702, Algorithms 3-4, Eq. 3-6, App. A.5-A.8).

    Inherits the block-diffusion parameters (the fallback rule is `remasking_strategy`). Routing:

    Args:
        do_verify_policy (`str`, defaults to "mask_span_length"): one of "mask_span_length",
            "score_threshold", "score_hysteresis", "contextual_bandit_ucb".
        min_ssd_span_length (`int`, defaults to 1): tau_span; 1 verifies at every step.
        do_verify_score_threshold (`float`, defaults to 0.0): tau_score.
        do_verify_score_type (`str`, defaults to "difference_dynamic"): Eq. 6 static or dynamic score.
        score_penalty_coef (`float`, defaults to 2.0): c of Eq. 6, >= 0.
        hysteresis_threshold_on / hysteresis_threshold_off (`float`, defaults to 0.0 / -1.0): on > off.
        token_acceptance_estimator (`str`, defaults to "hard_margin_threshold"): alpha_i of Eq. 5 (the paper's
            main experiments use "soft_entropy_negexp"; the presets do).
        ssd_confidence_margin_threshold (`float`, 0.05), ssd_entropy_temperature (`float`, 1.0),
        ssd_entropy_threshold (`float`, 0.5), ssd_confidence_power (`float`, 1.0),
        ssd_confidence_margin_coef (`float`, 1.0): estimator parameters.
        ucb_beta (`float`, 1.0), ucb_span_length_bins / ucb_block_progress_bins / ucb_entropy_bins (`int`, 2),
        ucb_entropy_source (`str`, "span" or "masked"): UCB bandit (App. A.6).
    Acceptance:
        ssd_ratio_tempering_factor (`float`, defaults to 1.0): gamma of min(1, (q/p)^gamma), > 0 (App. A.8).
        allow_resample (`bool`, defaults to True): draw the recovered token from (q - p)+ on rejection; False
            commits the rejected draft (SDAR reference).
        s2d2_acceptance (`str`, *optional*): "stochastic" (rejection sampling, Alg. 3) or "greedy_match"
            (accept iff draft = verifier argmax; deterministic; a documented deviation). `None` picks
            "greedy_match" without sampling and "stochastic" with `do_sample=True`.
    """

    decoding_strategy: ClassVar[str] = DecodingStrategyName.S2D2.value
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # S2D2 §5.1 Table 1 and strategies.md §5.8; all with low_confidence_dynamic 0.85 as the fallback.
        "sdar-1.7b-config-a": {"block_size": 4, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 2,
                               "token_acceptance_estimator": "soft_entropy_negexp"},
        "sdar-1.7b-config-b": {"block_size": 32, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 1,
                               **_SDAR_AR_CACHING},
        "sdar-4b-config-a": {"block_size": 16, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 1,
                             **_SDAR_AR_CACHING},
        "sdar-4b-config-b": {"block_size": 32, "do_verify_policy": "mask_span_length", "min_ssd_span_length": 1,
                             **_SDAR_AR_CACHING},
        "sdar-8b-config-a": {"block_size": 4, "do_verify_policy": "score_threshold", "do_verify_score_threshold": 0.0,
                             "do_verify_score_type": "difference_static", "score_penalty_coef": 1.0,
                             **_SDAR_AR_CACHING},
        "sdar-8b-config-b": {"block_size": 16, "do_verify_policy": "score_threshold", "do_verify_score_threshold": 0.0,
                             "do_verify_score_type": "difference_static", "score_penalty_coef": 0.0,
                             **_SDAR_AR_CACHING},
    }

    do_verify_policy: str = "mask_span_length"
    min_ssd_span_length: int = 1
    do_verify_score_threshold: float = 0.0
    do_verify_score_type: str = "difference_dynamic"
    score_penalty_coef: float = 2.0
    hysteresis_threshold_on: float = 0.0
    hysteresis_threshold_off: float = -1.0
    token_acceptance_estimator: str = "hard_margin_threshold"
    ssd_confidence_margin_threshold: float = 0.05
    ssd_entropy_temperature: float = 1.0
    ssd_entropy_threshold: float = 0.5
    ssd_confidence_power: float = 1.0
    ssd_confidence_margin_coef: float = 1.0
    ucb_beta: float = 1.0
    ucb_span_length_bins: int = 2
    ucb_block_progress_bins: int = 2
    ucb_entropy_bins: int = 2
    ucb_entropy_source: str = "span"
    ssd_ratio_tempering_factor: float = 1.0
    allow_resample: bool = True
    s2d2_acceptance: str | None = None

    def validate(self) -> None:
        super().validate()
        check_choice("do_verify_policy", self.do_verify_policy, POLICIES)
        _check_int("min_ssd_span_length", self.min_ssd_span_length, 1, "pass 1 to verify at every step")
        check_choice("do_verify_score_type", self.do_verify_score_type, SCORE_TYPES)
        check_choice("token_acceptance_estimator", self.token_acceptance_estimator, ESTIMATORS)
        check_choice("ucb_entropy_source", self.ucb_entropy_source, UCB_ENTROPY_SOURCES)
        for name in ("do_verify_score_threshold", "hysteresis_threshold_on", "hysteresis_threshold_off"):
            check_range(name, getattr(self, name), fix="pass a finite number")
        check_range("score_penalty_coef", self.score_penalty_coef, low=0.0, fix="pass c >= 0, e.g. 2.0")
        if self.hysteresis_threshold_on <= self.hysteresis_threshold_off:
            raise invalid("hysteresis_threshold_on", self.hysteresis_threshold_on,
                          f"be greater than `hysteresis_threshold_off` (={self.hysteresis_threshold_off})",
                          "raise the on threshold or lower the off threshold")
        check_range("ssd_ratio_tempering_factor", self.ssd_ratio_tempering_factor, low=0.0, low_open=True,
                    fix="pass gamma > 0; 1.0 is the unmodified rejection test")
        check_range("ssd_confidence_margin_threshold", self.ssd_confidence_margin_threshold, low=0.0, high=1.0,
                    fix="pass a probability margin such as 0.05")
        check_range("ssd_entropy_temperature", self.ssd_entropy_temperature, low=0.0, low_open=True,
                    fix="pass beta > 0, e.g. 1.0")
        check_range("ssd_entropy_threshold", self.ssd_entropy_threshold, low=0.0, high=1.0, low_open=True,
                    fix="pass a normalised entropy in (0, 1], e.g. 0.5")
        check_range("ssd_confidence_power", self.ssd_confidence_power, low=0.0, low_open=True,
                    fix="pass an exponent > 0, e.g. 1.0")
        check_range("ssd_confidence_margin_coef", self.ssd_confidence_margin_coef, low=0.0, low_open=True,
                    fix="pass a slope > 0, e.g. 1.0")
        check_range("ucb_beta", self.ucb_beta, low=0.0, fix="pass an exploration weight >= 0, e.g. 1.0")
        for name in ("ucb_span_length_bins", "ucb_block_progress_bins", "ucb_entropy_bins"):
            _check_int(name, getattr(self, name), 1, "pass a number of bins >= 1, e.g. 2")
        _check_bool("allow_resample", self.allow_resample)
        if self.s2d2_acceptance is not None:
            check_choice("s2d2_acceptance", self.s2d2_acceptance, ("greedy_match", "stochastic"),
                         "pass 'greedy_match', 'stochastic', or None for the default of the sampling mode")


CONFIG_CLASSES: dict[str, type[DecodingConfig]] = {
    cls.decoding_strategy: cls for cls in (ARConfig, BlockDiffusionConfig, S2D2Config)
}


def config_class_for(decoding_strategy: str) -> type[DecodingConfig]:
    """The config class of a strategy name.

    Raises:
        ValueError: for an unknown `decoding_strategy`, listing the valid names.
    """
    value = decoding_strategy.value if isinstance(decoding_strategy, Enum) else decoding_strategy
    check_choice("decoding_strategy", value, tuple(CONFIG_CLASSES),
                 f"pass one of {', '.join(map(repr, CONFIG_CLASSES))}")
    return CONFIG_CLASSES[value]


def resolve_config(
    decoding_strategy: str,
    *,
    generation_config: GenerationConfig | None = None,
    strategy_config: DecodingConfig | None = None,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> DecodingConfig:
    """Merge, lowest priority first: strategy defaults, the generation config's stored ``dllm_decoding``,
    a preset, an explicit config object, then the call's keyword overrides. Validates the result.

    Raises:
        ValueError: unknown strategy, preset or parameter; out-of-range value; a `strategy_config` of another
            strategy.
    """
    cls = config_class_for(decoding_strategy)
    params: dict[str, Any] = dict(cls.stored_defaults(generation_config))
    if preset is not None:
        params.update(cls.from_preset(preset).to_dict())
        params.pop("decoding_strategy")
    if strategy_config is not None:
        if not isinstance(strategy_config, cls):
            raise invalid("strategy_config", type(strategy_config).__name__,
                          f"be a {cls.__name__} for decoding_strategy={cls.decoding_strategy!r}",
                          f"build a {cls.__name__}, or change `decoding_strategy`")
        params.update({k: v for k, v in strategy_config.to_dict().items() if k != "decoding_strategy"})
    params.update(overrides or {})
    return cls.from_kwargs(**params)
