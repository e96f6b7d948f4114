"""The documentation site (`mkdocs.yml`, `docs/`) says what the code does (issue 36).

- Every public name (`hf_dllm_spec.__all__`, `model_patches.__all__`) has a docstring and a `::: path` entry in the
  API reference pages (mkdocstrings renders it there); `mkdocs build --strict` (CI) checks links and references.
- Every strategy page lists every field of its config class with the field's current default, and every preset.
- The Python examples of `docs/**/*.md` run as written, page by page, in one fresh process (the README's are run
  by `tests/test_newcomer.py`); a block right after a line `<!-- not run: <why> -->` (a server, a GPU, a Hub
  checkpoint, an extra) is skipped. The `hf-dllm-spec ...` command lines of the pages parse.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import hf_dllm_spec
import model_patches

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)
API_PAGES = sorted((DOCS / "api").glob("*.md"))
BLOCK = re.compile(r"(<!-- not run: [^>]+ -->\n)?```(\w+)[^\n]*\n(.*?)```", re.S)

#: decoding_strategy -> (its page, the config classes whose fields and presets it lists)
STRATEGY_PAGES = {
    "block_diffusion": ("strategies/block-diffusion.md", ("BlockDiffusionConfig",)),
    "ar": ("strategies/block-diffusion.md", ("ARConfig",)),
    "s2d2": ("strategies/s2d2.md", ("S2D2Config",)),
    "simsd": ("strategies/simsd.md", ("SimSDConfig",)),
    "deer": ("strategies/deer.md", ("DeerConfig",)),
    "fast_dllm_v2": ("strategies/fast-dllm-v2.md", ("FastDLLMV2Config",)),
    "llada2": ("strategies/llada2.md", ("LLaDA2DecodingConfig",)),
}


def blocks(page: pathlib.Path, language: str) -> list[tuple[str, bool]]:
    """The fenced blocks of `language` in a page, in order, with whether they are marked "not run"."""
    text = page.read_text(encoding="utf-8")
    return [(body, bool(skip)) for skip, lang, body in BLOCK.findall(text) if lang == language]


# ------------------------------------------------------------------------------------------------------------------
# No undocumented public name


#: Data constants documented by a `#:` comment, which mkdocstrings does not show: each should get a docstring (a
#: string right after the assignment), then leave this set.
KNOWN_UNDOCUMENTED = {"PATCHES", "CAUSAL_LM_PATCH", "ALIGNMENTS"}


def api_references() -> set[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in API_PAGES)
    return set(re.findall(r"^::: ([\w.]+)$", text, re.M))


def documented_data(module, name: str) -> bool:
    """A module-level name assigned at the top of `module` and followed by a string (its attribute docstring)."""
    tree = ast.parse(inspect.getsource(module))
    body = tree.body
    for i, node in enumerate(body):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            nxt = body[i + 1] if i + 1 < len(body) else None
            return isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
    return False


def defining_module(package, name: str):
    if package is hf_dllm_spec and name in hf_dllm_spec._EXPORTS:
        return importlib.import_module(f"hf_dllm_spec.{hf_dllm_spec._EXPORTS[name]}")
    obj = getattr(package, name)
    module = getattr(obj, "__module__", None)
    if module and (inspect.isclass(obj) or inspect.isfunction(obj)):
        return importlib.import_module(module)
    for mod in [package, *(importlib.import_module(f"{package.__name__}.{m}") for m in ("base", "causal_lm"))]:
        if name in vars(mod) and documented_data(mod, name):
            return mod
    return package


def has_docstring(package, name: str) -> bool:
    obj = getattr(package, name)
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
        doc = inspect.getdoc(obj) or ""
        auto = dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}(")   # dataclass's generated one
        return bool(doc.strip()) and not auto
    module = defining_module(package, name)
    return documented_data(module, name)


@pytest.mark.parametrize("package", [hf_dllm_spec, model_patches], ids=lambda p: p.__name__)
def test_every_public_name_has_a_docstring_and_an_api_entry(package):
    references = api_references()
    undocumented, missing = [], []
    for name in package.__all__:
        if package is hf_dllm_spec and name == "custom_generate":     # the alias of dllm_generate
            name = "dllm_generate"
        if not has_docstring(package, name):
            undocumented.append(name)
        if not any(ref == f"{package.__name__}.{name}" or ref.endswith(f".{name}") for ref in references):
            missing.append(name)
    assert not missing, f"public names without a `::: path` entry in docs/api/: {missing}"
    assert set(undocumented) <= KNOWN_UNDOCUMENTED, f"public names without a docstring: {undocumented}"


def test_api_entries_import():
    """Every `::: a.b.C` of the API pages names an object that exists (mkdocstrings would fail the build)."""
    for ref in sorted(api_references()):
        module, _, attr = ref.rpartition(".")
        try:
            obj = importlib.import_module(ref)
        except ImportError:
            obj = getattr(importlib.import_module(module), attr, None)
        assert obj is not None, ref


# ------------------------------------------------------------------------------------------------------------------
# Every parameter of every strategy, with its default


def formatted(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parameter_rows(page: pathlib.Path) -> dict[str, str]:
    """`name -> default cell` of the parameter tables of a page (rows `| `name` | default | ...`)."""
    rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", page.read_text(encoding="utf-8"), re.M)
    return dict(rows)


def test_every_builtin_strategy_has_a_page():
    assert {s.value for s in hf_dllm_spec.DecodingStrategyName} == set(STRATEGY_PAGES)


@pytest.mark.parametrize("strategy", list(STRATEGY_PAGES))
def test_strategy_page_lists_every_parameter_with_its_default_and_every_preset(strategy):
    page_name, classes = STRATEGY_PAGES[strategy]
    page = DOCS / page_name
    rows = parameter_rows(page)
    text = page.read_text(encoding="utf-8")
    for class_name in classes:
        cls = getattr(hf_dllm_spec, class_name)
        assert cls is hf_dllm_spec.config_class_for(strategy)
        for field in dataclasses.fields(cls):
            assert field.name in rows, f"{page_name}: no row for {class_name}.{field.name}"
            default = f"`{formatted(field.default)}`"
            assert default in rows[field.name], (f"{page_name}: {class_name}.{field.name} defaults to {default}, "
                                                 f"the page says {rows[field.name]!r}")
        for preset in cls.presets:
            assert f"`{preset}`" in text, f"{page_name}: preset {preset!r} of {class_name} is not listed"


# ------------------------------------------------------------------------------------------------------------------
# The pages' examples run as written

PRELUDE = """
import torch, hf_dllm_spec
from transformers import AutoModelForCausalLM, AutoTokenizer
hf_dllm_spec.register_auto_classes()
tok = AutoTokenizer.from_pretrained("models/sdar-tiny-arith")
model = AutoModelForCausalLM.from_pretrained("models/sdar-tiny-arith", dtype=torch.float32)
ids = tok("Question: Tom has 3 apples and gets 4 more. How many apples does Tom have now?\\nAnswer:",
          return_tensors="pt").input_ids
"""

RUNNER = """
import sys, traceback
pages = {pages!r}
prelude = {prelude!r}
failures = []
for page, sources in pages:
    namespace = {{"__name__": "__docs__"}}
    exec(compile(prelude, "<prelude>", "exec"), namespace)
    for index, source in enumerate(sources):
        try:
            exec(compile(source, f"{{page}} (python block {{index + 1}})", "exec"), namespace)
        except Exception:
            failures.append(f"{{page}}, python block {{index + 1}}:\\n" + traceback.format_exc()[-3000:])
            break
    print("ran", page, len(sources), flush=True)
if failures:
    sys.stderr.write("\\n".join(failures))
    sys.exit(1)
print("DOCS OK")
"""


def test_docs_python_examples_run_as_written(tmp_path):
    pages = []
    for page in PAGES:
        runnable = [body for body, skip in blocks(page, "python") if not skip]
        if runnable:
            pages.append((str(page.relative_to(ROOT)), runnable))
    assert len(pages) >= 10
    script = tmp_path / "docs_examples.py"
    script.write_text(RUNNER.format(pages=pages, prelude=PRELUDE))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    failures = proc.stderr[proc.stderr.find("docs/"):] if "docs/" in proc.stderr else proc.stderr
    assert proc.returncode == 0 and "DOCS OK" in proc.stdout, failures[-8000:]


def test_skipped_examples_say_why():
    for page in PAGES:
        for reason in re.findall(r"<!-- not run: ([^>]*) -->", page.read_text(encoding="utf-8")):
            assert len(reason.split()) >= 3, f"{page.name}: say why the block does not run"


def test_docs_command_lines_parse():
    """Every `hf-dllm-spec ...` line of the pages' bash blocks names a subcommand and options that exist."""
    from hf_dllm_spec import cli

    parser = cli.build_parser()
    lines = []
    for page in PAGES:
        for body, _ in blocks(page, "bash"):
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"^(\w+=\S+ )+", "", line.split("  #")[0].strip())     # leading VAR=value
                line = re.sub(r"^\S*/hf-dllm-spec ", "hf-dllm-spec ", line)          # .venv/bin/hf-dllm-spec
                if line.startswith("hf-dllm-spec "):
                    lines.append(line)
    assert len(lines) >= 15
    for line in lines:
        argv = [a for a in shlex.split(line)[1:] if a != "--help"]
        if argv:
            parser.parse_args(argv)     # argparse exits on an unknown option or a bad value
