"""What the wheel and sdist carry and declare: the license, the sdist's test suite, the extras."""

import os
import re
import textwrap
import tomllib
from pathlib import Path

import pytest
from fp8 import FP8_ON_CPU
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_ships_as_a_file_and_an_spdx_expression():
    """Apache-2.0 section 4(a) wants the license text to go with every copy, and setuptools deprecates the
    `license = {text = ...}` table (its builds stop being supported in 2027): the project names an SPDX
    expression and a license file, with a setuptools that understands both."""
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for section in range(1, 10):  # the whole of the terms, not a stub that names them
        assert f"\n   {section}. " in text
    assert "END OF TERMS AND CONDITIONS" in text
    (setuptools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    # 77 reads license-files and an SPDX license (older ones refuse the string); 77.0.3 fixed its first bugs
    assert "77.0.3" in setuptools.specifier and "77.0.2" not in setuptools.specifier


def files_the_manifest_adds() -> set[str]:
    """The files MANIFEST.in puts into the sdist, as setuptools' sdist reads it (cwd must be the root)."""
    from setuptools.command.egg_info import FileList

    files = FileList()
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            files.process_template_line(line)
    return {Path(f).as_posix() for f in files.files}


def test_the_sdist_carries_what_its_tests_need(monkeypatch):
    """setuptools puts tests/test_*.py into the sdist on its own, but not conftest.py and the helpers they import,
    nor the scripts/ and benchmarks/ they run: from an unpacked sdist, 5 test files failed to collect and 5 more
    lacked the ref_checkpoint fixture. Everything under those folders goes in (bytecode aside)."""
    monkeypatch.chdir(ROOT)
    shipped = files_the_manifest_adds()
    needed = {p.relative_to(ROOT).as_posix() for folder in ("tests", "scripts", "benchmarks")
              for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix != ".pyc"}
    assert {"tests/conftest.py", "tests/aten_ops.py", "scripts/train_sudoku.py"} <= needed
    assert needed - shipped == set()
    assert not any(f.endswith(".pyc") for f in shipped)


def shown_strings() -> list[tuple[str, str]]:
    """Every string the package can show ("path:line", text): its string constants, docstrings aside (comments are
    no constants)."""
    import ast

    found = []
    for path in sorted((ROOT / "blockpress").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found += [(f"{path.relative_to(ROOT)}:{node.lineno}", node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    return found


def test_messages_that_name_a_script_say_where_it_is():
    """scripts/ is in the source repository, not in the wheel: `train --help`, the token-shard errors and the sudoku
    check said "see scripts/" or "scripts/train_sudoku.py", which an installed user has nowhere. Every string the
    package shows that names scripts/ also says where to find it."""
    assert [(where, text) for where, text in shown_strings()
            if "scripts/" in text and "in a clone of the blockpress repository" not in text] == []


def test_messages_name_no_docs_page_an_install_lacks():
    """docs/ is in the source repository, not in the wheel: `quantize` said "see docs/quantization.md" and
    `generate --help` "(docs/cli.md)", pages an installed user has nowhere. No string the package shows sends one
    there."""
    assert [(where, text) for where, text in shown_strings() if re.search(r"docs/\w+\.md", text)] == []


def third_party_imports(path: Path) -> set[str]:
    """The top-level modules outside the standard library and blockpress that a file imports, at any depth."""
    import ast
    import sys

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return {n.partition(".")[0] for n in names} - set(sys.stdlib_module_names) - {"blockpress"}


def distributions_of(modules: set[str]) -> dict[str, set[str]]:
    """Each module's installed distributions (canonical names); a module installed by none is skipped."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    found = packages_distributions()
    missing = sorted(m for m in modules if m not in found)
    if missing:
        pytest.skip(f"not installed here: {missing}")
    return {m: {canonicalize_name(d) for d in found[m]} for m in modules}


def installed_by(requirements: list[str]) -> set[str]:
    """Every distribution these requirements install, what they require in turn included, read from the
    installed metadata (their own extras left out)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = [Requirement(r) for r in requires(requirement.name) or []]
        except PackageNotFoundError:
            pytest.skip(f"{requirement.name} is not installed here: what it requires cannot be read")
        todo += [r for r in needs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


@pytest.mark.parametrize("extra, module", [("serve", "serve.py"), ("train", "train.py")])
def test_an_extra_installs_what_its_modules_import(extra, module):
    """`pip install 'blockpress[serve]'` must be enough for blockpress/serve.py, start_in_background's httpx
    included (it came only through the openai client, which the server never imports), and [train] for train.py."""
    project = PYPROJECT["project"]
    installed = installed_by(project["dependencies"] + project["optional-dependencies"][extra])
    lacking = {m: d for m, d in distributions_of(third_party_imports(ROOT / "blockpress" / module)).items()
               if not d & installed}
    assert lacking == {}


@pytest.mark.parametrize("extra", ["serve", "train"])
def test_an_extra_lists_only_what_blockpress_imports(extra):
    """[serve] listed the openai client, which nothing in blockpress/ imports (the tests and benchmarks use it:
    the test extra has it): an extra names the packages blockpress's own code imports, each one."""
    from packaging.utils import canonicalize_name

    imported = set().union(*distributions_of(set().union(*(
        third_party_imports(p) for p in (ROOT / "blockpress").rglob("*.py")))).values())
    listed = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["optional-dependencies"][extra]}
    assert listed - imported == set()


@pytest.mark.parametrize("extra", ["serve", "train"])
def test_the_readme_says_how_to_install_an_extra_and_what_it_adds(extra):
    """The README (the package's long description) showed only the development setup: the extras the CLI's errors
    name ('blockpress[serve]') appeared nowhere. Its Install section has a line per extra naming its packages."""
    install = (ROOT / "README.md").read_text().split("\n## Install\n")[1].split("\n## ")[0]
    (line,) = [line for line in install.splitlines() if line.startswith(f"pip install '.[{extra}]'")]
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        assert Requirement(requirement).name in line


def test_the_wheel_marks_the_package_as_typed(tmp_path):
    """Without a py.typed marker (PEP 561) type checkers read none of the package's hints: to mypy, `import
    blockpress` in a user's code was 'Cannot find implementation or library stub for module named "blockpress"',
    and `blockpress.load(...).generate(...)` was Any. The marker is package data by name, and a wheel built from the sources carries it
    (the shipped models too). Built without the tests, scripts and models, to keep it quick."""
    import shutil
    import subprocess
    import sys
    import zipfile

    assert (ROOT / "blockpress" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["blockpress"]
    pytest.importorskip("setuptools", minversion="77.0.3")  # the build-system's; built here without isolation
    source = tmp_path / "src"
    shutil.copytree(ROOT / "blockpress", source / "blockpress",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "blockpress-sudoku"))
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "blockpress_launch.py"):
        shutil.copy(ROOT / name, source / name)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp_path / "dist"), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (wheel,) = (tmp_path / "dist").glob("blockpress-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "blockpress/py.typed" in names
    assert "blockpress/models/blockpress-code/config.json" in names

def test_the_version_is_written_once():
    """pyproject.toml and blockpress/__init__.py each wrote 0.1.0 by hand, with nothing keeping them in step:
    the distribution's version is read from blockpress.__version__."""
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "blockpress.__version__"}


def test_help_and_the_package_import_no_torch():
    """`blockpress --help` took about 4 s on this machine, 3.3 of them importing torch, which no help text needs:
    the package's names load on first use and the parser reads its choices from torch-free modules. Every
    command's --help is built; then the names still resolve (and import torch) when used."""
    import subprocess
    import sys

    code = """
import sys
import blockpress
from blockpress.cli import build_parser
parser = build_parser()
commands = next(a for a in parser._actions if a.choices and 'generate' in a.choices).choices
helps = [p.format_help() for p in commands.values()]
assert len(helps) >= 8 and all('--help' in h for h in helps)
assert 'torch' not in sys.modules, 'torch imported'
assert blockpress.SamplerConfig is blockpress.sampling.SamplerConfig and 'torch' in sys.modules
from blockpress import *  # noqa
assert KVCache is blockpress.cache.KVCache and all(globals()[n] is getattr(blockpress, n) for n in blockpress.__all__)
try:
    blockpress.no_such_name
except AttributeError as exc:
    assert "no attribute 'no_such_name'" in str(exc)
else:
    raise AssertionError('no AttributeError')
print('ok')
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_a_model_loads_on_torch_without_the_names_newer_releases_added():
    """pyproject declares torch>=2.6, and checkpoint.py named torch.float8_e8m0fnu (torch 2.7 on) at import: on 2.6
    no model loaded at all (AttributeError). Each module imports and blockpress-code generates with the names torch
    added after 2.6 taken away; a checkpoint of such a dtype is refused by name."""
    import subprocess
    import sys

    code = """
import torch
NEWER = ['float8_e8m0fnu']  # torch's dtypes past 2.6 that blockpress names
for name in NEWER:
    delattr(torch, name)
import importlib, pkgutil
import blockpress
for module in pkgutil.walk_packages(blockpress.__path__, 'blockpress.'):
    if module.name != 'blockpress.serve':  # (its extra's packages may be absent)
        importlib.import_module(module.name)
lm = blockpress.load('blockpress-code')
out = lm.generate('def f(x):', max_new_tokens=8, max_denoising_steps=2, seed=0)
assert out.num_new_tokens[0] > 0
from blockpress.checkpoint import _ST_DTYPES
assert 'F8_E8M0' not in _ST_DTYPES
print('ok')
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_what_type_checkers_see_is_what_the_package_exports():
    """The TYPE_CHECKING block re-exports (`X as X`) exactly the names and modules of _EXPORTS: an editor that
    resolves `blockpress.load` reads the module the package itself would import it from."""
    import ast

    import blockpress

    tree = ast.parse((ROOT / "blockpress" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name} is not re-exported as itself"
            seen[alias.name] = node.module
    assert seen == blockpress._EXPORTS
    # and __all__ is a literal list (checkers read no other) of the same names: `from blockpress import *` gave
    # mypy none of them while `sorted(_EXPORTS)` computed it
    (assign,) = [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"]
    assert isinstance(assign.value, ast.List), "__all__ is computed: type checkers cannot read it"
    assert blockpress.__all__ == sorted(blockpress._EXPORTS)



def mypy_errors(tmp_path, program: str) -> dict[int, str]:
    """mypy's errors on a user's program that imports this checkout's blockpress, by line: what a typed user's
    checker reports. torch is left unfollowed (its Tensor reads as Any): its stubs take most of a minute to analyse,
    and each call checked here is about blockpress's own hints. Errors inside blockpress are silenced, as for an
    installed package."""
    import subprocess
    import sys

    pytest.importorskip("mypy")  # requirements-dev.txt's
    (tmp_path / "user.py").write_text(textwrap.dedent(program))
    (tmp_path / "mypy.ini").write_text("[mypy]\nfollow_imports = silent\n[mypy-torch.*]\nfollow_imports = skip\n")
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", ".cache",
                          "--no-error-summary", "--hide-error-context", "user.py"],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "MYPYPATH": str(ROOT)},
                         timeout=300)
    assert run.returncode in (0, 1) and not run.stderr, run.stdout + run.stderr
    errors: dict[int, str] = {}
    for line in run.stdout.splitlines():
        match = re.match(r"user\.py:(\d+): error: (.*)", line)
        if match:
            errors.setdefault(int(match[1]), match[2])
    return errors


def test_a_typed_users_checker_reads_the_packages_names(tmp_path):
    """What a user's mypy makes of `import blockpress`. The lazy-import __getattr__ was visible to checkers, for
    which a module with one has every attribute: `blockpress.laod(...)` (a typo, an AttributeError at run time)
    passed mypy --strict as Any, and everything computed from it went unchecked. A computed __all__ left
    `from blockpress import *` defining none of its names to mypy. Each line marked `# error` is an
    error, and no other line is."""
    program = """
    import blockpress
    import blockpress.lm

    from blockpress import *

    lm: blockpress.LM = blockpress.load("blockpress-code")
    star: LM = load("blockpress-code")
    greedy: GenerationOutput = star.generate("def f(x):", sampler=SamplerConfig(sampler="greedy"))
    blockpress.laod("blockpress-code")  # error
    config = blockpress.SamplerConfg(sampler="greedy")  # error
    out: blockpress.GenerateOutput  # error
    model: blockpress.lm.LM = lm
    """
    lines = textwrap.dedent(program).splitlines()
    expected = {number for number, line in enumerate(lines, 1) if line.endswith("# error")}
    errors = mypy_errors(tmp_path, program)
    assert set(errors) == expected, errors


def test_a_typed_users_checker_takes_what_the_calls_take(tmp_path):
    """Hints narrower than the code: per-row settings as an array (what the docs show for max_new_tokens and say of
    the others), a cancelled= that answers with an array of flags, an attention mask as a list, stop strings as a
    tuple or a Sequence[str]: each call runs, and mypy refused each. A setting of the wrong kind is still an error
    (one of no tensor: torch is not followed here, so a hint that takes a tensor takes anything), and so is a
    misspelt sampler or ranking (SamplerConfig's choices are Literal types)."""
    program = """
    from collections.abc import Sequence

    import numpy as np

    import blockpress

    lm = blockpress.load("blockpress-code")
    rows = ["def f(x):", "class A:"]
    stops: Sequence[str] = ("\\n\\n", "\\ndef ")
    for event in lm.stream(rows, max_new_tokens=8, cancelled=lambda: np.array([False, True]), stop=stops):
        pass
    for event in lm.stream(rows, max_new_tokens=8, min_new_tokens=[2, 2], min_new_tokens_eos_only=np.array([True, False])):
        pass
    lm.generate_ar(rows, max_new_tokens=4, temperature=np.array([0.5, 1.0]), top_k=np.array([3, 5]), seed=0)
    lm.generate_ar(rows, max_new_tokens=4, temperature=0.7, top_p=np.array([0.9, 1.0]), stop=("\\n",), seed=0)
    lm.logits([[2, 3]], [5] * 8, attention_mask=[[1, 1]])
    lm.generate_ar(rows, max_new_tokens=4, stop=3)  # error
    lm.generate(rows, sampler=blockpress.SamplerConfig(sampler="greedy", rank_by="margin", candidates="argmax"))
    blockpress.SamplerConfig(sampler="gredy")  # error
    blockpress.SamplerConfig(rank_by="entropi")  # error
    """
    lines = textwrap.dedent(program).splitlines()
    expected = {number for number, line in enumerate(lines, 1) if line.endswith("# error")}
    errors = mypy_errors(tmp_path, program)
    assert set(errors) == expected, errors


def test_the_readmes_layout_names_every_module():
    """The README's Layout section, the map of the package, left out live.py, response.py, files.py and
    tasks/code.py. Each module is named there (as `name.py`, `tasks/name.py`, `cli/name.py` or `blockpress/name.py`; a package's
    __init__ / __main__ aside), and each .py file it names exists."""
    layout = (ROOT / "README.md").read_text().split("\n## Layout\n")[1].split("\n## ")[0]
    named = set(re.findall(r"`((?:blockpress/)?(?:(?:tasks|cli)/)?\w+\.py)`", layout))
    package = ROOT / "blockpress"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name[:2] != "__"}
    in_package = {name.removeprefix("blockpress/") for name in named}
    left_out = modules - in_package
    assert not left_out, f"the README's Layout leaves out {sorted(left_out)}"
    assert all((package / name).exists() or (ROOT / name).exists() for name in in_package)


DOC_PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_code_block_of_the_docs_opens_once_and_closes(page):
    """The README's Command line block opened with two ```bash lines: a fence that closes takes no language, so the
    second was the block's first line and showed as text above the commands. A fence with a language inside an open
    block is such a line, and every block that opens closes."""
    opened = None
    for number, line in enumerate((ROOT / page).read_text().splitlines(), start=1):
        fence = re.match(r"(`{3,})(.*)", line)
        if fence is None:
            continue
        if opened is None:
            opened = number
        else:
            assert not fence.group(2).strip(), f"{page}:{number}: {line!r} inside the block opened at line {opened}"
            opened = None
    assert opened is None, f"{page}: the block opened at line {opened} never closes"


def heading_anchors(text: str) -> set[str]:
    """The #fragments GitHub gives a page's headings: lower case, punctuation but - and _ dropped, spaces as -, and
    -1, -2 ... after a repeated one; headings inside code blocks are code."""
    repeats: dict[str, int] = {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            repeats[slug] = repeats.get(slug, -1) + 1
    return {f"{slug}-{n}" if n else slug for slug, count in repeats.items() for n in range(count + 1)}


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_relative_link_of_the_docs_leads_somewhere(page):
    """The README's detail moved to docs/, so its links and the pages' links to each other (and to a section,
    `serving.md#shutdown`) are how a reader finds it: each relative link names a file that exists, and a #fragment
    one of that page's headings."""
    source = ROOT / page
    links = re.findall(r"\]\(([^)\s]+)\)", source.read_text())
    assert links or page != "README.md", "the README's links were not found"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto: ...: not this repository's
            continue
        path, _, fragment = link.partition("#")
        target = (source.parent / path).resolve() if path else source
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif fragment and target.suffix == ".md" and fragment not in heading_anchors(target.read_text()):
            broken.append(f"{link} (no such heading in {target.name})")
    assert not broken, f"{page}: {broken}"


@pytest.mark.parametrize("page", ["README.md", "docs/python-api.md"])
def test_the_docs_python_never_rebinds_an_input_it_leaves_to_the_reader(page):
    """docs/python-api.md's TextStream example bound `ids`, the reader's token-id tensor that its earlier
    `input_ids=ids` takes, to a list (and `reply`, a GenerationOutput further on, to a TextStream): a reader who runs
    the page, or type-checks it, met a name of two types. The inputs (those the run test below supplies) are
    bound by the reader alone; `+=` (adding to the conversation) extends one."""
    import ast

    inputs = {"prompt_ids", "canvas_ids", "prompts", "ids", "mask", "before", "after", "turn1", "turn2_new_tokens",
              "messages", "system", "question"}
    text = (ROOT / page).read_text()
    code = "\n".join(block.split("```")[0] for block in text.split("\n## Python API\n")[-1].split("```python\n")[1:])
    tree = ast.parse(code)
    extended = {id(node.target) for node in ast.walk(tree) if isinstance(node, ast.AugAssign)}
    rebound = sorted({(node.id, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Name)
                      and isinstance(node.ctx, ast.Store) and node.id in inputs and id(node) not in extended})
    assert not rebound, f"{page} binds the reader's inputs: {rebound} (line of its Python blocks)"
@pytest.mark.parametrize("page", ["README.md", "docs/python-api.md"])
def test_the_readme_python_api_block_runs_as_written_in_order(tmp_path, monkeypatch, page):
    """A reader runs the Python API block (the README's short one, docs/python-api.md's whole one) top to bottom,
    supplying only the inputs it leaves to them (a prompt, token ids, a conversation). It rebound two of its own names
    on the way: `prompts = PrefixCache(...)`, so its later `lm.generate(prompts, max_new_tokens=256)` was refused
    ("got PrefixCache"), and `lm = load(..., quantize="fp8")`, so its `lm.save("out/")` was refused (a quantized model
    cannot be saved). Every statement runs here on blockpress-code on the CPU, with answers cut to one canvas to keep
    it quick."""
    import ast

    import torch

    import blockpress
    from blockpress.lm import LM

    text = (ROOT / page).read_text()
    # the README's block under its Python API heading; every block of docs/python-api.md, one section each, in order
    blocks = [block.split("```")[0] for block in text.split("\n## Python API\n")[-1].split("```python\n")[1:]]
    code = "\n".join(blocks if page.startswith("docs/") else blocks[:1])
    code = (code.replace('"/path/to/diffusiongemma-26B-A4B-it"', '"blockpress-code"').replace('"cuda"', '"cpu"')
            # 50 GB of random weights: counted on the meta device, as the line's own advice says
            .replace('gemma_26b_a4b(), dtype="bfloat16", device="cpu"', 'gemma_26b_a4b(), dtype="bfloat16", device="meta"')
            .replace('first_layers(6), dtype="bfloat16", device="cpu"', 'first_layers(6), dtype="bfloat16", device="meta"'))
    if not FP8_ON_CPU:  # torch 2.6 and 2.7 have no CPU kernel for fp8 (see fp8.py): int8 stands in for the calls
        code = code.replace('quantize="fp8"', 'quantize="int8"')

    def capped(method, steps: bool):
        """The method, with answers of at most 16 tokens (8 denoising steps a canvas): what is checked is that each
        call is taken, not its text."""
        def call(self, prompt=None, max_new_tokens=None, **kwargs):
            if "max_length" in kwargs:
                kwargs["max_length"] = min(kwargs["max_length"], len(prompt_of(prompt, kwargs)) + 16)
            elif max_new_tokens is None and kwargs.get("template") is None:  # (a template sets its own length)
                max_new_tokens = 16
            max_new_tokens = ([min(n, 16) for n in max_new_tokens] if isinstance(max_new_tokens, list)
                              else None if max_new_tokens is None else min(max_new_tokens, 16))
            if kwargs.get("min_new_tokens") is not None:  # a minimum past 16 raises the length the call may write
                least = kwargs["min_new_tokens"]
                kwargs["min_new_tokens"] = [min(n, 16) for n in least] if isinstance(least, list) else min(least, 16)
            if steps:
                kwargs["max_denoising_steps"] = min(kwargs.get("max_denoising_steps") or 8, 8)
            return method(self, prompt, max_new_tokens, **kwargs)
        return call

    def prompt_of(prompt, kwargs):
        return kwargs["input_ids"][0] if prompt is None else prompt

    monkeypatch.setattr(LM, "stream", capped(LM.stream, steps=True))
    monkeypatch.setattr(LM, "generate_ar", capped(LM.generate_ar, steps=False))
    monkeypatch.setattr(LM, "compile", lambda self: self)  # (minutes of inductor on a CPU; its own tests time it)
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)  # (two threads on two busy cores take minutes; the fixture restores the count)
    code_lm = blockpress.load("blockpress-code")
    ids = torch.tensor([code_lm.tokenizer.encode("def f(x):")] * 2)
    # the inputs the block leaves to its reader, by the names it uses
    given = {"prompt_ids": ids[:1], "canvas_ids": torch.full((1, 32), 5), "prompts": ["def f(x):", "class A:"],
             "ids": ids, "mask": torch.ones_like(ids), "before": "def area(r):\n    return ", "after": "\n",
             "turn1": "def f(x):", "turn2_new_tokens": "\n\ndef g(y):", "messages": [{"role": "user", "content": "hi"}],
             "system": "You answer in Python.\n" * 4, "question": "def f(x):"}
    scope = dict(given)
    failed = []
    for statement in ast.parse(code).body:
        try:
            exec(compile(ast.Module([statement], []), page, "exec"), scope)
        except Exception as exc:  # noqa: BLE001 (each statement is reported, not the first alone)
            failed.append(f"line {statement.lineno} of the block: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)
    assert (tmp_path / "out" / "model.safetensors").exists()
