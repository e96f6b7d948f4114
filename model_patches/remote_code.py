"""The families' remote-code shims: what lets a saved checkpoint load with `trust_remote_code=True` alone.

A checkpoint directory of a family with its own classes (SDAR, Fast-dLLM v2, LLaDA2) carries two small modules,
`configuration_hf_dllm_spec.py` and `modeling_hf_dllm_spec.py`, named by its `config.json` `auto_map`. Each
imports the family class from the installed package (inside a `try` block: transformers' import check skips
`try` blocks, so a missing package fails with the message below) and subclasses it, so that transformers'
remote-code bookkeeping (`register_for_auto_class`) lands on the shim class, never on the family's own.

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
SHIM_MODULES = {"AutoConfig": CONFIG_SHIM, "AutoModelForCausalLM": MODEL_SHIM}  # Auto class -> shim module
DISTRIBUTION = "hf-dllm-spec"
#: How the distribution that holds the family classes is installed (it is not on a package index).
INSTALL_HINT = "install the hf-dllm-spec package from its repository checkout: pip install -e <checkout>"

_SHIM = '''"""Remote-code shim written by hf-dllm-spec ({version}).

`{source}.{name}` lives in the installed `hf-dllm-spec` package; this file only imports it,
so that `{auto}.from_pretrained(<this checkpoint>, trust_remote_code=True)` works without
`import hf_dllm_spec`.
"""

try:  # transformers' import check skips try blocks, so a missing package fails with the message below
    from {source} import {name} as _{name}
except ImportError as error:
    raise ImportError(
        "This checkpoint's `{name}` comes from the `hf-dllm-spec` package, which could not be "
        f"imported ({{error}}); {hint}"
    ) from error


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


def family_classes_of(config_class: type) -> tuple[str, str, str]:
    """`(module, config class name, causal-LM class name)` of the family config in `config_class`'s MRO.

    The family config is the class that declares :attr:`ShimsConfigMixin.causal_lm_class_name`; its causal-LM
    class lives in the same module. A shim subclass (loaded as remote code) resolves to the family's own class.

    Raises:
        ValueError: if no class in the MRO declares `causal_lm_class_name`.
    """
    for cls in config_class.__mro__:
        if "causal_lm_class_name" in vars(cls):
            return cls.__module__, cls.__name__, cls.causal_lm_class_name
    raise ValueError(f"`config_class` (={config_class.__name__}) must be a family config of model_patches that "
                     "declares `causal_lm_class_name`; write shims for SDARConfig, Fast_dLLM_QwenConfig or "
                     "LLaDA2MoeConfig (or a subclass).")


def write_shims(directory: str | os.PathLike, config_class: type) -> dict[str, str]:
    """Write the two shim modules for `config_class`'s family into `directory`.

    Args:
        directory (`str` or `os.PathLike`): an existing checkpoint directory.
        config_class (`type`): the family's config class (or a shim subclass of it).

    Returns:
        `dict[str, str]`: the `auto_map` that names the shims, e.g. ``{"AutoConfig":
        "configuration_hf_dllm_spec.SDARConfig", "AutoModelForCausalLM": "modeling_hf_dllm_spec.SDARForCausalLM"}``.

    Raises:
        ValueError: if `config_class` is not a family config (see :func:`family_classes_of`).
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    module, config_name, model_name = family_classes_of(config_class)
    directory = pathlib.Path(directory)
    mapping = {}
    for (auto_class, shim), name in zip(SHIM_MODULES.items(), (config_name, model_name)):
        text = _SHIM.format(version=version, source=module, name=name, auto=auto_class, hint=INSTALL_HINT,
                            body=_CONFIG_INIT if auto_class == "AutoConfig" else "")
        (directory / f"{shim}.py").write_text(text, encoding="utf-8")
        mapping[auto_class] = f"{shim}.{name}"
    return mapping


class ShimsConfigMixin:
    """Config mixin of the families with their own classes: a Hub repository's own `auto_map` is dropped on load;
    one naming the shims is kept, and saving writes the shims again, so a saved directory still loads with
    `trust_remote_code=True` alone.

    Put it before the transformers config class and name the family's causal-LM class (same module)::

        class SDARConfig(ShimsConfigMixin, Qwen3Config):
            causal_lm_class_name = "SDARForCausalLM"
    """

    #: The family's causal-LM class, defined in the config class's module (read by :func:`write_shims`).
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
