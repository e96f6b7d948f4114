"""The families' remote-code shims: what lets a saved checkpoint load with `trust_remote_code=True` alone.

A checkpoint directory of a family with its own classes (SDAR, Fast-dLLM v2, LLaDA2) carries two small modules,
`configuration_hf_dllm_spec.py` (the config class) and `modeling_hf_dllm_spec.py` (the base model and the causal LM),
named by its `config.json` `auto_map` (`AutoConfig`, `AutoModel`, `AutoModelForCausalLM`, as the families' Hub
repositories name theirs). Each imports the family classes from the installed package (inside a `try` block:
transformers' import check skips `try` blocks, so a missing package fails with the message below) and subclasses
them, so that transformers' remote-code bookkeeping (`register_for_auto_class`) lands on the shim classes, never on
the family's own.

:class:`ShimsConfigMixin` is the config side: a Hub repository's own `auto_map` (naming remote code this
package replaces) is dropped on load; one naming the shims is kept, and `save_pretrained` writes the shims
again. `hf_dllm_spec.export_checkpoint` writes the rest of an exported checkpoint (card, `custom_generate/`).
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
from typing import Any, ClassVar

CONFIG_SHIM = "configuration_hf_dllm_spec"
MODEL_SHIM = "modeling_hf_dllm_spec"
#: Auto class -> shim module (the base model and the causal LM share one).
SHIM_MODULES = {"AutoConfig": CONFIG_SHIM, "AutoModel": MODEL_SHIM, "AutoModelForCausalLM": MODEL_SHIM}
DISTRIBUTION = "hf-dllm-spec"
#: How the distribution that holds the family classes is installed (it is not on a package index).
INSTALL_HINT = "install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"

_SHIM = '''"""Remote-code shim written by hf-dllm-spec ({version}).

The classes below live in the installed `hf-dllm-spec` package (`{source}`); this file only
imports them, so that {autos} loads this checkpoint with `trust_remote_code=True`
without `import hf_dllm_spec`.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
{imports}
except ImportError as error:
    raise ImportError(
        "This checkpoint's classes come from the `hf-dllm-spec` package, which could not be "
        f"imported ({{error}}); "
        "{hint}"
    ) from error
{classes}'''

_SHIM_CLASS = '''

class {name}(_{name}):
    """`{source}.{name}`, as this checkpoint's remote code."""
{body}'''

#: The config shim's own `__init__`: transformers (5.17 to 5.24, `PreTrainedConfig.__init_subclass__`) makes a
#: config subclass without one a dataclass whose generated `__init__` never runs the family's (its defaults for keys
#: a Hub `config.json` lacks, its attention fallback).
_CONFIG_INIT = '''
    def __init__(self, **kwargs):  # without it, transformers' generated __init__ would skip the family's
        super().__init__(**kwargs)
'''


def names_shims(value: Any) -> bool:
    """Whether an `auto_map` value points only at the shims (a Hub repository's own remote code does not).

    Args:
        value (`Any`): a config's `auto_map` (a mapping of Auto class names to `"[repo--]module.Class"`).

    Returns:
        `bool`: True for a non-empty mapping whose every entry names a module in `SHIM_MODULES`.
    """
    if not isinstance(value, dict) or not value:
        return False
    modules = set(SHIM_MODULES.values())
    return all(isinstance(ref, str) and ref.split("--")[-1].split(".")[0] in modules for ref in value.values())


def family_classes_of(config_class: type) -> tuple[str, dict[str, str]]:
    """`(module, {Auto class: class name})` of the family config in `config_class`'s MRO: its config, base model
    and causal-LM classes under `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`.

    The family config is the class that declares :attr:`ShimsConfigMixin.causal_lm_class_name` (and
    :attr:`ShimsConfigMixin.base_model_class_name`); both classes live in the same module. A shim subclass (loaded
    as remote code) resolves to the family's own class.

    Raises:
        ValueError: if no class in the MRO declares `causal_lm_class_name`.
    """
    for cls in config_class.__mro__:
        if "causal_lm_class_name" in vars(cls):
            return cls.__module__, {"AutoConfig": cls.__name__, "AutoModel": cls.base_model_class_name,
                                    "AutoModelForCausalLM": cls.causal_lm_class_name}
    raise ValueError(f"`config_class` (={config_class.__name__}) must be a family config of model_patches that "
                     "declares `causal_lm_class_name`; write shims for SDARConfig, Fast_dLLM_QwenConfig or "
                     "LLaDA2MoeConfig (or a subclass).")


def write_shims(directory: str | os.PathLike, config_class: type) -> dict[str, str]:
    """Write the two shim modules for `config_class`'s family into `directory` (the config class in one, the base
    model and the causal LM in the other).

    Args:
        directory (`str` or `os.PathLike`): an existing checkpoint directory.
        config_class (`type`): the family's config class (or a shim subclass of it).

    Returns:
        `dict[str, str]`: the `auto_map` that names the shims, e.g. ``{"AutoConfig":
        "configuration_hf_dllm_spec.SDARConfig", "AutoModel": "modeling_hf_dllm_spec.SDARModel",
        "AutoModelForCausalLM": "modeling_hf_dllm_spec.SDARForCausalLM"}``.

    Raises:
        ValueError: if `config_class` is not a family config (see :func:`family_classes_of`).
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    module, names = family_classes_of(config_class)
    directory = pathlib.Path(directory)
    for shim in dict.fromkeys(SHIM_MODULES.values()):
        autos = [a for a, s in SHIM_MODULES.items() if s == shim]
        classes = [names[a] for a in autos]
        text = _SHIM.format(
            version=version, source=module, hint=INSTALL_HINT, autos=" / ".join(f"`{a}`" for a in autos),
            imports="\n".join(f"    from {module} import {n} as _{n}" for n in classes),
            classes="".join(_SHIM_CLASS.format(source=module, name=n, body=_CONFIG_INIT if a == "AutoConfig" else "")
                            for a, n in zip(autos, classes)))
        (directory / f"{shim}.py").write_text(text, encoding="utf-8")
    return {auto: f"{shim}.{names[auto]}" for auto, shim in SHIM_MODULES.items()}


class ShimsConfigMixin:
    """Config mixin of the families with their own classes: a Hub repository's own `auto_map` is dropped on load;
    one naming the shims is kept, and saving writes the shims again, so a saved directory still loads with
    `trust_remote_code=True` alone.

    Put it before the transformers config class and name the family's base model and causal-LM classes (same
    module)::

        class SDARConfig(ShimsConfigMixin, Qwen3Config):
            base_model_class_name = "SDARModel"
            causal_lm_class_name = "SDARForCausalLM"
    """

    #: The family's base model class (`AutoModel`), defined in the config class's module (read by
    #: :func:`write_shims`).
    base_model_class_name: ClassVar[str]
    #: The family's causal-LM class (`AutoModelForCausalLM`), defined there too.
    causal_lm_class_name: ClassVar[str]

    def __init__(self, **kwargs):
        if not names_shims(kwargs.get("auto_map")):
            kwargs.pop("auto_map", None)
        super().__init__(**kwargs)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """`PreTrainedConfig.save_pretrained`, plus the remote-code shims when `auto_map` names them."""
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        if names_shims(getattr(self, "auto_map", None)):
            write_shims(save_directory, type(self))


__all__ = ["CONFIG_SHIM", "INSTALL_HINT", "MODEL_SHIM", "SHIM_MODULES", "ShimsConfigMixin", "family_classes_of",
           "names_shims", "write_shims"]
