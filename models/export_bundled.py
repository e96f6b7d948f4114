"""Bring the bundled checkpoints to the exported form, in place, with the library's own exporter.

    python models/export_bundled.py        # after a change to the shims, the Hub folder or the card text

Each diffusion checkpoint (SDAR, Fast-dLLM v2, LLaDA2) gets what `hf_dllm_spec.export_checkpoint` writes: the
`auto_map`, the two shim modules, `custom_generate/` and the card section, so it loads with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` in a process that never imported the package.
The AR target `qwen2-tiny-ar` is a stock transformers Qwen2 (no remote code for the model): it gets the
`custom_generate/` folder only, which transformers binds to `generate` at `from_pretrained(...,
trust_remote_code=True)`. Weights and tokenizer files are not touched (tests/test_newcomer.py checks that
running this again changes nothing).
"""

from __future__ import annotations

import importlib.resources
import pathlib

MODELS = pathlib.Path(__file__).resolve().parent
#: The bundled checkpoints of the families with their own classes (exported with shims).
FAMILY_MODELS = ("sdar-tiny-arith", "sdar-large", "deer-drafter-tiny", "fast-dllm-v2-tiny", "llada2-tiny")
#: The bundled stock transformers checkpoints (the `custom_generate/` folder only).
STOCK_MODELS = ("qwen2-tiny-ar",)


def copy_custom_generate(directory: pathlib.Path) -> None:
    """Copy the package's `custom_generate/` folder (its single source) into `directory`."""
    from hf_dllm_spec.hub.export import CUSTOM_GENERATE_FILES

    source = importlib.resources.files("hf_dllm_spec") / "hub" / "custom_generate"
    (directory / "custom_generate").mkdir(exist_ok=True)
    for name in CUSTOM_GENERATE_FILES:
        (directory / "custom_generate" / name).write_bytes((source / name).read_bytes())


def main() -> None:
    from hf_dllm_spec import export_checkpoint

    for name in FAMILY_MODELS:
        export_checkpoint(MODELS / name, MODELS / name)
        print(f"exported models/{name} in place")
    for name in STOCK_MODELS:
        copy_custom_generate(MODELS / name)
        print(f"copied custom_generate/ into models/{name}")


if __name__ == "__main__":
    main()
