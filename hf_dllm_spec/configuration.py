"""The base of the strategy configurations: validation, presets, and the `generation_config.json` round trip.

Each strategy's own config dataclass lives beside the strategy (`strategies/block_diffusion.py`,
`strategies/s2d2.py`); `hf_dllm_spec.strategies.registry` maps `decoding_strategy` to both. Parameter names and defaults
follow the papers and their reference code (the S2D2 names are those of the S2D2 reference implementation, so
its command lines port one to one). A config validates when built and again inside `generate` after the call's
overrides are merged (:func:`merge_parameters`).

Round trip: :meth:`DecodingConfig.save_to_generation_config` writes a ``dllm_decoding`` dict (strategy name
plus every parameter) into a `GenerationConfig`; `generate(decoding_strategy=X)` reads it back as the
defaults for strategy X. On the library's diffusion model classes, `generate()` without `decoding_strategy`
runs the stored strategy with these parameters (`DllmGenerationMixin`); so does the `custom_generate` callable on
other models (a stock Qwen target, say), which without either a `decoding_strategy` or a stored one refuses the call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from transformers import GenerationConfig

from model_patches.generation import GENERATION_CONFIG_KEY, stored_decoding  # the families read it too

from .validation import check_choice, check_int, invalid


@dataclass
class DecodingConfig:
    """Base of the strategy configs: validation, presets, dict and generation-config round trip.

    A config remembers which parameters it was built with; as `strategy_config` it overrides exactly those
    (and any changed afterwards). `dataclasses.replace` and `from_dict` pass every field, so their results
    override every field.
    """

    decoding_strategy: ClassVar[str] = ""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Inherited fields this strategy does not read: any value but None is refused (never silently ignored).
    unused_fields: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> "DecodingConfig":
        # Remember which parameters the caller set, so a config object overrides exactly those (merge_parameters).
        obj = super().__new__(cls)
        names = [f.name for f in fields(cls)]
        object.__setattr__(obj, "_explicit", frozenset(names[: len(args)]) | frozenset(kwargs))
        return obj

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first bad parameter, its value, the rule and the fix (here: a value for
        one of :attr:`unused_fields`)."""
        for name in self.unused_fields:
            if getattr(self, name) is not None:
                raise invalid(name, getattr(self, name), f"be unset for decoding_strategy="
                              f"{self.decoding_strategy!r}, which does not read it", f"drop `{name}`")

    def stochastic_acceptance(self) -> tuple[str, str] | None:
        """`(parameter, value)` when this config asks for a random acceptance rule (rejection sampling of the
        drafts), else None; under `do_sample=False` such a rule needs an explicit `generator`."""
        return None

    def check_acceptance(self, do_sample: bool) -> None:
        """Raise `ValueError` for a parameter the acceptance rule of this sampling mode does not read (set to other
        than its default, it would be ignored); nothing by default."""

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
        return cls.from_kwargs(**{**cls._preset_fields(name), **overrides})

    @classmethod
    def _preset_fields(cls, name: str) -> dict[str, Any]:
        """The fields preset `name` sets (see `presets`).

        Raises:
            ValueError: for an unknown preset name, or one that is not a string (listing the valid ones).
        """
        if not isinstance(name, str) or name not in cls.presets:
            check_choice("preset", name, tuple(cls.presets) or ("<none>",),
                         f"use one of the presets of decoding_strategy={cls.decoding_strategy!r}")
        return cls.presets[name]

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
        """Store this config under ``generation_config.dllm_decoding``; `save_pretrained` then writes it.

        The generation config is marked as not derived from the model config (`_from_model_config = False`, as
        transformers does when a generation config is edited): transformers drops every key it does not know
        (this one) when it loads a `generation_config.json` marked as derived, which a model's default config is.
        """
        setattr(generation_config, GENERATION_CONFIG_KEY, self.to_dict())
        generation_config._from_model_config = False
        return generation_config

    @classmethod
    def stored_defaults(cls, generation_config: GenerationConfig | None) -> dict[str, Any]:
        """Parameters stored for this strategy in a generation config (empty when none or another strategy)."""
        stored = stored_decoding(generation_config)
        if stored is None or stored["decoding_strategy"] != cls.decoding_strategy:
            return {}
        return {k: v for k, v in stored.items() if k != "decoding_strategy"}

    def explicit_parameters(self) -> dict[str, Any]:
        """Parameters set when this object was built, or changed since: what a config object overrides."""
        defaults = type(self)()
        explicit = getattr(self, "_explicit", frozenset())
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in explicit or getattr(self, f.name) != getattr(defaults, f.name)}


@dataclass
class DrafterConfig(DecodingConfig):
    """Parameters of strategies that run a separate drafter model (`generate(..., draft_model=...)`).

    Parameters that mean different things for the two models are named apart: `block_size` is the target's,
    `draft_block_size` the drafter's.

    Args:
        draft_block_size (`int`, *optional*): the drafter's block size in tokens; `None` uses the drafter's
            trained block size (`draft_model.config.block_size`).
    """

    draft_block_size: int | None = None

    def stochastic_acceptance(self) -> tuple[str, str] | None:
        """`("acceptance", "rejection_sampling")` when asked for (the drafter strategies' `acceptance` field)."""
        value = getattr(self, "acceptance", None)
        return ("acceptance", value) if value == "rejection_sampling" else None

    def validate(self) -> None:
        super().validate()
        if self.draft_block_size is not None:
            check_int("draft_block_size", self.draft_block_size, 1, "pass a positive number of tokens, e.g. 4")


def merge_parameters(
    cls: type[DecodingConfig],
    *,
    generation_config: GenerationConfig | None = None,
    preset: str | None = None,
    strategy_config: DecodingConfig | None = None,
    overrides: dict[str, Any] | None = None,
) -> DecodingConfig:
    """Merge field by field, lowest priority first, and validate the result.

    Order: the strategy's defaults < the generation config's stored ``dllm_decoding`` < the preset's listed
    fields < the fields `strategy_config` was built with (or that differ from the defaults) < the call's
    keyword `overrides`.

    Raises:
        ValueError: unknown preset or parameter; out-of-range value; a `strategy_config` of another strategy.
    """
    params: dict[str, Any] = dict(cls.stored_defaults(generation_config))
    if preset is not None:
        params.update(cls._preset_fields(preset))
    if strategy_config is not None:
        if not isinstance(strategy_config, cls) or type(strategy_config) is not cls:
            raise invalid("strategy_config", type(strategy_config).__name__,
                          f"be a {cls.__name__} for decoding_strategy={cls.decoding_strategy!r}",
                          f"build a {cls.__name__}, or change `decoding_strategy`")
        params.update(strategy_config.explicit_parameters())
    params.update(overrides or {})
    return cls.from_kwargs(**params)

