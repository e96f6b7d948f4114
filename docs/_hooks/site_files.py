"""MkDocs hook: the committed benchmark plots (`benchmarks/results/**/*.png`) on the site.

The pages link the plots by their path in the repository (`../benchmarks/results/frontier.png` from `docs/`), which
GitHub renders; the site serves the same files under `results/` and this hook rewrites those links to it, so
nothing is copied into `docs/`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PLOTS = ROOT / "benchmarks" / "results"
LINK = re.compile(r"\]\(([^)\s]+\.png)\)")


def on_files(files, config):
    for path in sorted(PLOTS.rglob("*.png")):
        files.append(File.generated(config, "results/" + path.relative_to(PLOTS).as_posix(), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    here = Path(page.file.abs_src_path).parent

    def rewrite(match: re.Match) -> str:
        target = (here / match.group(1)).resolve()
        if PLOTS in target.parents:
            site_uri = "results/" + target.relative_to(PLOTS).as_posix()
            return "](" + os.path.relpath(site_uri, os.path.dirname(page.file.src_uri) or ".").replace(os.sep, "/") + ")"
        return match.group(0)

    return LINK.sub(rewrite, markdown)
