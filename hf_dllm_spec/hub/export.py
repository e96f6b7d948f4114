"""Export a checkpoint that loads with `trust_remote_code=True` alone, in a process that never imported hf_dllm_spec.

:func:`export_checkpoint` writes, beside the weights:

- `config.json` with an `auto_map` (`AutoConfig`, `AutoModel`, `AutoModelForCausalLM`, as the families' Hub
  repositories name theirs) naming two shim modules;
- the shims `configuration_hf_dllm_spec.py` and `modeling_hf_dllm_spec.py`, which import the family classes
  from the installed package (`model_patches.remote_code`: the families own their shims; the names are
  re-exported here);
- `custom_generate/` (`generate.py`, `requirements.txt`), copied from the package's single source
  `hf_dllm_spec/hub/custom_generate/`;
- `README.md`, a model card with Hub front matter (`library_name: transformers`, `pipeline_tag:
  text-generation`, tags `hf-dllm-spec` and `custom_generate`); an existing card keeps its body and other keys.

>>> from hf_dllm_spec import export_checkpoint
>>> export_checkpoint(model, "out/", tokenizer=tokenizer)                                    # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained("out/", trust_remote_code=True)  # fresh process    # doctest: +SKIP
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib
import shutil
from typing import Any

from model_patches.remote_code import (CONFIG_SHIM, INSTALL_HINT, MODEL_SHIM, SHIM_MODULES, ShimsConfigMixin,
                                       names_shims, write_shims)

from ..validation import invalid

CARD_TAGS = ("hf-dllm-spec", "custom_generate")
CUSTOM_GENERATE_FILES = ("generate.py", "requirements.txt")
#: Names a checkpoint directory's copy leaves out (a git clone's `.git`, huggingface_hub's `.cache` of a download).
COPY_IGNORED = (".git", ".cache")
_USAGE_HEADING = "## Loading with `trust_remote_code`"

_USAGE = '''{heading}

This checkpoint carries an `auto_map` and two small shim modules (`{config_shim}.py`,
`{model_shim}.py`) that import the model classes from the `hf-dllm-spec` package
({install}), so it loads in a process that never imported that package:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("<this directory or repo>", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("<this directory or repo>", trust_remote_code=True)
ids = tokenizer("Question: 2 + 3 = ?\\nAnswer:", return_tensors="pt").input_ids
out = model.generate(ids, decoding_strategy="s2d2", max_new_tokens=48)
```

`custom_generate/` runs the same strategies through transformers' `custom_generate` hook:
`model.generate(ids, custom_generate="<this directory or repo>", trust_remote_code=True,
decoding_strategy="s2d2")`. After `import hf_dllm_spec; hf_dllm_spec.register_auto_classes()` the
checkpoint also loads without remote code.
'''


def _family_classes(model_type: Any) -> tuple[type, type]:
    """The `(config class, causal-LM class)` of the family with its own classes for `model_type`.

    Raises:
        ValueError: for a model type no family with its own classes serves, listing the ones that exist.
    """
    import model_patches

    pairs = [pair for patch in model_patches.PATCHES for pair in patch.auto_classes]
    for config_class, model_class in pairs:
        if config_class.model_type == model_type:
            return config_class, model_class
    supported = ", ".join(repr(config_class.model_type) for config_class, _ in pairs)
    raise invalid("model_type", model_type, f"be a family with its own model classes ({supported})",
                  "export a checkpoint of such a family; other families load with their stock transformers classes "
                  "and need no remote code")


def _write_custom_generate(directory: pathlib.Path) -> None:
    source = importlib.resources.files("hf_dllm_spec") / "hub" / "custom_generate"
    target = directory / "custom_generate"
    target.mkdir(exist_ok=True)
    for name in CUSTOM_GENERATE_FILES:
        (target / name).write_bytes((source / name).read_bytes())


def _read_card(path: pathlib.Path, name: str):
    """The model card to write: the one at `path` (a `README.md` with Hub front matter) or a new one named `name`.

    Raises:
        ValueError: naming `source`, for a `README.md` whose front matter is no YAML mapping.
    """
    from huggingface_hub import ModelCard

    if not path.is_file():
        return ModelCard(f"---\nlibrary_name: transformers\n---\n\n# {name}\n\n"
                         "A diffusion language model checkpoint exported by hf-dllm-spec.\n")
    try:
        return ModelCard(path.read_text(encoding="utf-8"))
    except Exception as error:          # yaml's parser errors, huggingface_hub's "should be a dict" ValueError
        raise invalid("source", str(path), "have a README.md whose front matter (between the `---` lines) is a "
                      f"YAML mapping ({type(error).__name__}: {str(error).splitlines()[0]})",
                      "fix or remove the README's front matter, then export again") from None


def _write_card(card, path: pathlib.Path) -> None:
    """`card` with the Hub keys and the loading section added, written to `path`."""
    data = card.data
    data.library_name = "transformers"
    data.pipeline_tag = data.pipeline_tag or "text-generation"
    data.tags = list(data.tags or []) + [tag for tag in CARD_TAGS if tag not in (data.tags or [])]
    if _USAGE_HEADING not in card.text:
        card.text = card.text.rstrip("\n") + "\n\n" + _USAGE.format(
            heading=_USAGE_HEADING, config_shim=CONFIG_SHIM, model_shim=MODEL_SHIM, install=INSTALL_HINT)
    path.write_text(str(card).rstrip("\n") + "\n", encoding="utf-8")


def export_checkpoint(source: Any, output_dir: str | os.PathLike, *, tokenizer: Any = None,
                      overwrite: bool = False) -> pathlib.Path:
    """Write a checkpoint that `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads alone.

    Args:
        source (`PreTrainedModel`, `str` or `os.PathLike`): a loaded model of a family with its own classes
            (e.g. `SDARForCausalLM`), saved with `save_pretrained`; or a checkpoint directory, whose files are
            copied unchanged (weights byte for byte) apart from `config.json`'s `auto_map` and the card, and without
            `.git` or `.cache` folders (:data:`COPY_IGNORED`). `output_dir` may equal a source directory: the
            export then happens in place.
        output_dir (`str` or `os.PathLike`): the directory to write.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): saved beside the weights when given.
        overwrite (`bool`, defaults to `False`): allow writing into a non-empty `output_dir` that is not `source`
            (the export's files replace theirs; other files stay).

    Returns:
        `pathlib.Path`: `output_dir`.

    Raises:
        ValueError: for a source that is neither a model nor a checkpoint directory, a family without its own
            classes (plain Qwen3 needs no remote code), a source `README.md` whose front matter is no YAML mapping,
            an `output_dir` that is no path, a non-empty one without `overwrite=True`, one inside a source directory
            (other than the source itself) or one that is a file, a `tokenizer` without `save_pretrained`, an
            `overwrite` that is no bool; all before anything is written.
    """
    if not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir):
        raise invalid("output_dir", output_dir, "be a directory path (a non-empty str or os.PathLike; an empty one "
                      "would be the working directory)", "pass e.g. \"out/my-checkpoint\"")
    if not isinstance(overwrite, bool):
        raise invalid("overwrite", overwrite, "be True or False", "pass overwrite=True to write into a non-empty "
                      "output_dir")
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise invalid("tokenizer", tokenizer if isinstance(tokenizer, str) else type(tokenizer).__name__,
                      "be a loaded tokenizer (with save_pretrained)",
                      "pass AutoTokenizer.from_pretrained(...)'s result; a checkpoint directory's own tokenizer files "
                      "are copied with it")
    output = pathlib.Path(output_dir)
    is_model = hasattr(source, "save_pretrained") and hasattr(source, "config")
    if not is_model:
        if not isinstance(source, (str, os.PathLike)) or not (pathlib.Path(source) / "config.json").is_file():
            raise invalid("source", source, "be a loaded model or a checkpoint directory with a config.json",
                          "pass the model object, or the directory that save_pretrained wrote")
        in_place = output.resolve() == pathlib.Path(source).resolve()
        if not in_place and pathlib.Path(source).resolve() in output.resolve().parents:
            raise invalid("output_dir", str(output), "not lie inside the source directory (the copy of the source "
                          "would copy itself)", "pass a directory outside the source, or the source itself to "
                          "export in place")
    else:
        in_place = False
    if output.exists() and not output.is_dir():
        raise invalid("output_dir", str(output), "be a directory (a file is there)", "pass another path")
    if not in_place and output.is_dir() and any(output.iterdir()) and not overwrite:
        raise invalid("output_dir", str(output), "be empty or new", "pass overwrite=True or another directory")

    if is_model:
        model_type = getattr(source.config, "model_type", None)
    else:
        model_type = json.loads((pathlib.Path(source) / "config.json").read_text(encoding="utf-8")).get("model_type")
    config_class, _ = _family_classes(model_type)
    card = _read_card((output if is_model else pathlib.Path(source)) / "README.md", output.resolve().name)

    output.mkdir(parents=True, exist_ok=True)
    if is_model:
        source.save_pretrained(output)
    elif not in_place:        # a clone's version control and download caches are no part of the checkpoint
        shutil.copytree(source, output, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*COPY_IGNORED))
    if tokenizer is not None:
        tokenizer.save_pretrained(output)

    config_path = output / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = write_shims(output, config_class)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    config_class.from_pretrained(output)  # the written config must load with the family's class
    _write_custom_generate(output)
    _write_card(card, output / "README.md")
    return output


__all__ = ["CONFIG_SHIM", "COPY_IGNORED", "CUSTOM_GENERATE_FILES", "INSTALL_HINT", "MODEL_SHIM", "SHIM_MODULES",
           "ShimsConfigMixin", "export_checkpoint", "names_shims", "write_shims"]
