"""The code follows the data: library modules import no pass; passes do no file I/O."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = {"cli.py", "api.py"}  # they run the passes, so they may import them


def imported_modules(source: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def imports_a_pass(source: str) -> bool:
    return any(m in ("passes", "cfp.passes") or m.startswith(("passes.", "cfp.passes."))
               for m in imported_modules(source))


def test_no_library_module_imports_a_pass():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "cfp").rglob("*.py")
                 if p.name not in ENTRY_POINTS or p.parent != ROOT / "cfp"
                 if imports_a_pass(p.read_text())]
    assert offenders == []
    # The check finds an import wherever it stands (a planted one, at the top and in a body).
    assert imports_a_pass("from cfp.passes.search import run_search\n")
    assert imports_a_pass("def f():\n    import passes.profile as p\n")
    assert imports_a_pass("import passes.search\n")
    assert not imports_a_pass("from cfp.passes_util import x\nimport passesx\n")


def test_passes_do_no_file_io():
    """The work dir is the CLI's: a pass reads no file and writes none."""
    io_names = {"open", "write_record", "read_record", "write_text", "read_text",
                "write_bytes", "read_bytes", "mkdir"}

    def io_calls(source):
        return sorted({n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
                       for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                       and (getattr(n.func, "attr", None) in io_names
                            or getattr(n.func, "id", None) in io_names)})

    for p in (ROOT / "passes").glob("*.py"):
        assert io_calls(p.read_text()) == [], p.name
    assert io_calls("def f(p):\n    p.write_text('x')\n") == ["write_text"]


def test_install_adds_no_top_level_passes_module(tmp_path):
    """The passes are installed as cfp.passes; outside the source tree ``passes`` is no
    module (run against the installed package, as CI does)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda code: subprocess.run([sys.executable, "-c", code], cwd=tmp_path,  # noqa
                                      env=env, capture_output=True, text=True)
    assert run("import cfp.passes.search").returncode == 0
    missing = run("import passes")
    assert missing.returncode != 0 and "No module named 'passes'" in missing.stderr


def reaches_into_scripts(source: str) -> bool:
    """Whether test code puts ``scripts/`` on the import path or imports a script."""
    scripts = {p.stem for p in (ROOT / "scripts").rglob("*.py")} | {"enum_and_benchmark",
                                                                   "diagnostics", "scripts"}
    return ('"scripts"' in source and "sys.path" in source) or any(
        m.split(".")[0] in scripts for m in imported_modules(source))


def test_no_test_imports_from_scripts():
    """Logic a test needs lives in ``cfp/`` (``cfp.bench`` for the benchmarks' tables);
    scripts only drive it. Control: the check finds a path insert and a script's import."""
    offenders = [p.name for p in (ROOT / "cfp_test").glob("*.py")
                 if p.name != "test_layout.py"  # this file: the check's planted examples
                 and reaches_into_scripts(p.read_text())]
    assert offenders == []
    assert reaches_into_scripts('sys.path.insert(0, str(ROOT / "scripts"))\n')
    assert reaches_into_scripts("def f():\n    from summarize import main\n")
    assert not reaches_into_scripts("from cfp.bench import summarize\n")


def unindexed_results(results: Path) -> tuple[list[str], list[str]]:
    """(files under ``results`` its README.md does not name, names there with no file)."""
    import re
    index = (results / "README.md").read_text() if (results / "README.md").exists() else ""
    named = set(re.findall(r"^\| `([^`]+)` \|", index, flags=re.M))
    files = {str(p.relative_to(results)) for p in results.rglob("*")
             if p.is_file() and p.name != "README.md"}
    return sorted(files - named), sorted(named - files)


def test_every_results_file_is_in_the_index(tmp_path):
    """``scripts/results/README.md`` names every file there with its claim, command, date
    and commit, and names no file that is gone. Control: a file added beside the index, and
    an entry whose file is deleted, are both found."""
    assert unindexed_results(ROOT / "scripts" / "results") == ([], [])
    (tmp_path / "README.md").write_text("| `a.csv` | 2026-01-01 | abc |\n"
                                        "| `gone.csv` | 2026-01-01 | abc |\n")
    (tmp_path / "a.csv").write_text("x")
    (tmp_path / "new.csv").write_text("x")
    assert unindexed_results(tmp_path) == (["new.csv"], ["gone.csv"])


SCRIPT_LINES_MAX = 3000


def unnamed_scripts(scripts: Path) -> list[str]:
    """The files under ``scripts`` (its results aside) that its README.md does not name."""
    readme = (scripts / "README.md").read_text() if (scripts / "README.md").exists() else ""
    return sorted(str(p.relative_to(scripts)) for p in scripts.rglob("*")
                  if p.is_file() and "results" not in p.relative_to(scripts).parts
                  and p.name != "README.md" and "__pycache__" not in p.parts
                  and str(p.relative_to(scripts)) not in readme)


def test_scripts_are_few_and_each_is_named(tmp_path):
    """scripts/ holds the drivers, the benchmarks and what the README quotes, each named in
    scripts/README.md, under SCRIPT_LINES_MAX lines in all. Control: an unnamed file is
    found, and a named one is not."""
    scripts = ROOT / "scripts"
    code = [p for p in scripts.rglob("*") if p.suffix in (".py", ".sh")
            and "results" not in p.relative_to(scripts).parts]
    assert sum(len(p.read_text().splitlines()) for p in code) < SCRIPT_LINES_MAX
    assert unnamed_scripts(scripts) == []
    (tmp_path / "README.md").write_text("| `named.py` | what it writes |\n")
    (tmp_path / "named.py").write_text("")
    (tmp_path / "stray.py").write_text("")
    assert unnamed_scripts(tmp_path) == ["stray.py"]


README_LINES_MAX = 300


def too_long(text: str, most: int = README_LINES_MAX) -> bool:
    return len(text.splitlines()) > most


def test_the_readme_is_at_most_300_lines():
    """The README is for users: at most README_LINES_MAX lines (the method's detail is in
    passes/README.md, every figure's run in scripts/README.md). Control: one line more is
    too long."""
    text = (ROOT / "README.md").read_text()
    assert not too_long(text)
    assert too_long("\n" * README_LINES_MAX + "one line more")


def test_the_suite_passes_xla_only_flags_it_knows():
    """The suite adds XLA's CPU fusion-emitter flag only where this XLA accepts it (an unknown
    flag ends the process that starts XLA). Control: a flag XLA has not is refused."""
    import os
    from conftest import NO_FUSION_EMITTERS, _xla_knows
    assert not _xla_knows("--xla_cpu_no_such_flag=true")
    assert (NO_FUSION_EMITTERS in os.environ["XLA_FLAGS"]) == _xla_knows(NO_FUSION_EMITTERS)
