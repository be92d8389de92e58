"""The docs' commands run as written: every block of README.md and docs/*.md marked `<!-- runnable -->`.

A bash block runs in a new shell in the repository root (set -e: every line must succeed); a python block
is executed in a fresh namespace. They use the demo model and the synthetic presets, as a newcomer would.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runnable -->"


def _blocks():
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    text = path.read_text()
    for m in re.finditer(re.escape(MARK) + r"\s*\n```(bash|python)\n(.*?)```", text, re.S):
      line = text[:m.start()].count("\n") + 1
      # A block that runs the demo model (the CLI's default, or by name) downloads it the first time.
      demo = re.search(r"jaxllm\.generate(?!.*synthetic:)|smollm2-135m|qwen2\.5-coder", m.group(2))
      yield pytest.param(m.group(1), m.group(2), id=f"{path.relative_to(ROOT)}:{line}",
                         marks=[pytest.mark.network] if demo else [])


BLOCKS = list(_blocks())


def test_the_docs_mark_runnable_blocks():
  files = {b.id.split(":")[0] for b in BLOCKS}
  assert {"docs/usage.md", "docs/benchmarks.md", "docs/cuda-graphs.md"} <= files, files


@pytest.mark.parametrize("lang, code", BLOCKS)
def test_doc_block_runs(lang, code, tmp_path):
  if lang == "bash":
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{code}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
  else:
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{code}\nstderr:\n{proc.stderr[-3000:]}"
