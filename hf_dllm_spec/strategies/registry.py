"""One registry: `decoding_strategy` name -> strategy class (its config class is `strategy.config_class`).

Third-party strategies register with :func:`register_strategy`; `generate(decoding_strategy=...)`, the
parameter routing of the `custom_generate` callable and the error messages all read this table.
"""

from __future__ import annotations

import dataclasses
import threading
from enum import Enum
from typing import Any, Callable

from transformers import GenerationConfig

from ..bridge import check_routable
from ..configuration import DecodingConfig, merge_parameters
from .base import DRAFTER_KINDS, TARGET_KINDS, DecodingStrategy
from .block_diffusion import ARStrategy, BlockDiffusionStrategy
from .deer import DeerStrategy
from .fast_dllm_v2 import FastDLLMV2Strategy
from .llada2 import LLaDA2Strategy
from .s2d2 import S2D2Strategy
from .simsd import SimSDStrategy
from ..validation import check_choice, invalid

STRATEGIES: dict[str, type[DecodingStrategy]] = {}
"""`decoding_strategy` name -> strategy class, the built-in strategies and those added by `register_strategy`
(each class names its config in `config_class`)."""


class DecodingStrategyName(str, Enum):
    """Values of `generate(decoding_strategy=...)` for the built-in strategies."""

    AR = "ar"
    BLOCK_DIFFUSION = "block_diffusion"
    S2D2 = "s2d2"
    FAST_DLLM_V2 = "fast_dllm_v2"
    DEER = "deer"
    SIMSD = "simsd"
    LLADA2 = "llada2"


#: Called after every registration (the `custom_generate` callable refreshes the keywords it accepts).
_LISTENERS: list[Callable[[], None]] = []
#: One registration at a time (a registration and its listeners' refresh are one step).
_LOCK = threading.RLock()


def on_register(listener: Callable[[], None]) -> None:
    """Call `listener()` now and after every :func:`register_strategy` (how the layers above learn of a new strategy
    without this module importing them); a listener that fails now is not kept."""
    with _LOCK:
        listener()
        _LISTENERS.append(listener)


def register_strategy(strategy: type[DecodingStrategy]) -> type[DecodingStrategy]:
    """Add `strategy` under `strategy.name` (replacing an entry of that name); usable as a class decorator.

    Its config class must name the strategy (`decoding_strategy` ClassVar); a config class that does not set its
    own gets `strategy.name`. Its parameters become keyword arguments of `hf_dllm_spec.dllm_generate` (so
    `generate` routes them), and the CLI and the server offer them.

    A registration that fails leaves the registry and the keywords `generate` accepts as they were.

    Raises:
        ValueError: if `strategy` has no `name` or no `config_class`, a `target_kind` / `drafter_kind` that is not
            one of `TARGET_KINDS` / `DRAFTER_KINDS` (a `drafter_kind` other than "any" without `uses_drafter`), a
            `check_models` method (no longer called), its config class names another strategy, has
            a parameter without a default, or one named like an argument of transformers' `generate`, a
            `GenerationConfig` option or an argument of `dllm_generate` (`hf_dllm_spec.bridge.check_routable`:
            transformers would hand it to the strategies instead).
    """
    name = getattr(strategy, "name", None)
    if not isinstance(name, str) or not name or name != name.strip() or any(c.isspace() for c in name):
        raise invalid("strategy.name", name, "be a non-empty string without spaces: the `decoding_strategy` value",
                      f"set `name = \"mine\"` on {strategy.__name__}")
    config_class = getattr(strategy, "config_class", None)
    if not (isinstance(config_class, type) and issubclass(config_class, DecodingConfig)):
        raise invalid("strategy.config_class", config_class, "be a DecodingConfig subclass",
                      f"define a dataclass config for {strategy.__name__} and set `config_class` to it")
    check_choice("strategy.target_kind", strategy.target_kind, TARGET_KINDS)
    check_choice("strategy.drafter_kind", strategy.drafter_kind, DRAFTER_KINDS)
    if strategy.drafter_kind != "any" and not strategy.uses_drafter:
        raise invalid("strategy.drafter_kind", strategy.drafter_kind, "stay 'any' on a strategy without a drafter "
                      "(`uses_drafter=False`): there is no drafter to check", "set `uses_drafter = True`, or drop it")
    if hasattr(strategy, "check_models"):                 # the base class has none: the strategy's own or a mixin's
        raise invalid("strategy.check_models", strategy.__name__, "not be defined: the plan checks the models against "
                      "the kinds the strategy declares, and calls no `check_models`",
                      "declare `target_kind` / `drafter_kind`, or raise in the strategy's `__init__` (it runs "
                      "before any forward)")
    own = vars(config_class).get("decoding_strategy")
    if own is not None and own != name:
        raise invalid(f"{config_class.__name__}.decoding_strategy", own, f"name the strategy it configures ({name!r})",
                      f"give {strategy.__name__} its own config subclass with decoding_strategy = {name!r}")
    required = [f.name for f in dataclasses.fields(config_class) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    if required:
        raise invalid(f"{config_class.__name__}.{required[0]}", "<no default>", "have a default: a strategy's "
                      "parameters are optional keywords of generate (and the CLI lists every config's defaults)",
                      f"give `{required[0]}` a default value")
    check_routable(config_class.parameter_names())           # before the registry changes (calls read it meanwhile)
    with _LOCK:
        previous = STRATEGIES.get(name)
        STRATEGIES[name] = strategy
        if own is None:
            config_class.decoding_strategy = name          # inherited from another strategy's config: its own now
        try:
            _notify()
        except Exception:
            if own is None:
                del config_class.decoding_strategy
            if previous is None:
                del STRATEGIES[name]
            else:
                STRATEGIES[name] = previous
            _notify()
            raise
    return strategy


def _notify() -> None:
    for listener in _LISTENERS:
        listener()


for _strategy in (ARStrategy, BlockDiffusionStrategy, S2D2Strategy, FastDLLMV2Strategy, DeerStrategy, SimSDStrategy,
                  LLaDA2Strategy):
    register_strategy(_strategy)


#: The entry point group under which installed packages declare their strategies (a strategy class each).
PLUGIN_GROUP = "hf_dllm_spec.strategies"


def load_strategy_plugins() -> list[str]:
    """Register the strategies installed packages declare under the entry point group :data:`PLUGIN_GROUP`
    (``name = "module:StrategyClass"``); the command line and the server call it at start.

    Returns:
        `list[str]`: the names registered.

    Raises:
        ValueError: if an entry point does not load to a strategy class (naming the entry point and the package).
    """
    from importlib.metadata import entry_points

    names = []
    for entry in entry_points(group=PLUGIN_GROUP):
        try:
            strategy = entry.load()
        except Exception as error:                     # noqa: BLE001 - any import error of the plugin, reported
            raise invalid(f"entry point {entry.name}", entry.value, f"load ({type(error).__name__}: {error})",
                          f"fix or uninstall the package that declares it in the {PLUGIN_GROUP!r} group") from error
        if not (isinstance(strategy, type) and issubclass(strategy, DecodingStrategy)):
            raise invalid(f"entry point {entry.name}", entry.value, "name a DecodingStrategy subclass",
                          f"point the {PLUGIN_GROUP!r} entry point at the strategy class")
        register_strategy(strategy)
        names.append(strategy.name)
    return names


def get_strategy(decoding_strategy: str) -> type[DecodingStrategy]:
    """The strategy class of a name.

    Raises:
        ValueError: for an unknown `decoding_strategy`, listing the valid names.
    """
    value = decoding_strategy.value if isinstance(decoding_strategy, Enum) else decoding_strategy
    names = tuple(STRATEGIES)
    check_choice("decoding_strategy", value, names, f"pass one of {', '.join(map(repr, names))}")
    return STRATEGIES[value]


def config_class_for(decoding_strategy: str) -> type[DecodingConfig]:
    """The config class of a strategy name (see :func:`get_strategy` for the errors)."""
    return get_strategy(decoding_strategy).config_class


def strategy_parameter_names() -> tuple[str, ...]:
    """Every parameter of every registered strategy config, in a stable order."""
    names: list[str] = []
    for strategy in tuple(STRATEGIES.values()):              # a snapshot: a registration may run meanwhile
        names += [n for n in strategy.config_class.parameter_names() if n not in names]
    return tuple(names)


def resolve_config(
    decoding_strategy: str,
    *,
    generation_config: GenerationConfig | None = None,
    strategy_config: DecodingConfig | None = None,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> DecodingConfig:
    """The validated config of `decoding_strategy`, merged field by field (see
    :func:`~hf_dllm_spec.configuration.merge_parameters`): stored < preset < strategy_config < keywords.

    Raises:
        ValueError: unknown strategy, preset or parameter; out-of-range value; a `strategy_config` of another
            strategy; a preset of another strategy (naming that strategy).
    """
    config_class = config_class_for(decoding_strategy)
    if isinstance(preset, str) and preset not in config_class.presets:
        owners = [name for name, strategy in tuple(STRATEGIES.items()) if preset in strategy.config_class.presets]
        if owners:
            raise invalid("preset", preset, f"be a preset of decoding_strategy={config_class.decoding_strategy!r} "
                          f"(it is one of decoding_strategy={owners[0]!r})", f"pass decoding_strategy={owners[0]!r}")
    return merge_parameters(config_class, generation_config=generation_config, preset=preset,
                            strategy_config=strategy_config, overrides=overrides)
