"""One lab: every developer program lives under ``lab/``; ``scripts/`` holds the user commands
and CI's scripts only; ``benchmarks/`` holds results only; nothing outside the lab and the
tests imports the lab, nothing reaches across folders with ``sys.path``, and the wheel installs
no top-level ``lab`` package into users' environments. Checked statically (nothing imported)."""

import ast
import re
import subprocess
from pathlib import Path

from builders.imports import imported_names

ROOT = Path(__file__).resolve().parents[2]

#: what a user runs (README.md, docs/) and what CI runs (.ci/run)
USER_COMMANDS = {"check_data.py", "count_tokens.py", "export.py", "generate_features.py", "import_reference.py",
                 "push_to_hub.py", "regenerate_data.py", "serve_check.py", "vllm_env.sh"}
CI_SCRIPTS = {"ci_floor.sh"}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an unpacked sdist): the folders as they are
        return sorted(p for pat in patterns for p in ROOT.glob(pat))
    return [ROOT / line for line in out.stdout.splitlines()]


def test_scripts_holds_the_user_commands_and_ci_scripts_only():
    names = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()}
    assert names == USER_COMMANDS | CI_SCRIPTS, (
        f"scripts/ holds {sorted(names - USER_COMMANDS - CI_SCRIPTS)} beyond the user commands and CI's scripts "
        f"(a developer program belongs under lab/) and lacks {sorted(USER_COMMANDS | CI_SCRIPTS - names)}")


def test_every_user_command_is_documented_for_users():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    undocumented = sorted(n for n in USER_COMMANDS if f"scripts/{n}" not in docs)
    assert not undocumented, f"scripts/ commands no page tells a user to run: {undocumented}"


def test_benchmarks_holds_results_only():
    programs = [str(p.relative_to(ROOT)) for p in _tracked("benchmarks/**") if p.suffix in (".py", ".sh")]
    assert not programs, f"programs among the results (move them under lab/): {programs}"


def test_nothing_outside_the_lab_and_the_tests_imports_the_lab():
    files = [p for p in _tracked("*.py") if p.parts[len(ROOT.parts)] not in ("lab", "tests")]
    importers = sorted(str(p.relative_to(ROOT)) for p in files
                       if any(n == "lab" or n.startswith("lab.") for n in imported_names(p)))
    assert not importers, f"files outside lab/ and tests/ that import the lab: {importers}"


def test_no_file_reaches_across_folders_through_sys_path():
    bridges = sorted(str(p.relative_to(ROOT)) for p in _tracked("*.py")
                     if p.resolve() != Path(__file__).resolve() and "sys.path." in p.read_text())
    assert not bridges, f"sys.path edits (import the module by its package name instead): {bridges}"


def test_the_wheel_installs_the_product_only():
    """setuptools' own package search over pyproject.toml's include: no top-level `lab`."""
    from setuptools import find_packages

    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.packages.find]")[1].split("\n[")[0]
    include = ast.literal_eval(re.search(r"^include\s*=\s*(\[.*?\])", section, re.M)[1])
    exclude = re.search(r"^exclude\s*=\s*(\[.*?\])", section, re.M)
    packages = find_packages(str(ROOT), include=include, exclude=ast.literal_eval(exclude[1]) if exclude else ())
    assert "msd_train" in packages and "msd_train.decoding" in packages
    assert not [p for p in packages if not p.startswith("msd_train")], packages


def test_committed_results_and_heads_name_no_path_of_the_machine_that_made_them():
    """A report, a result or a head's config read by a user names folders relative to the checkout
    or with a placeholder (WORK/, TMP/), never where one machine kept them: also inside the
    commands results record (``python -m lab.portable FILES --folder PATH=WORK --write`` rewrites them)."""
    from lab.portable import machine_paths

    files = _tracked("benchmarks/**.json", "benchmarks/**/report.md", "data/**.json")
    found = {str(p.relative_to(ROOT)): left[:3] for p in files
             if p.stat().st_size < 5_000_000 and (left := machine_paths(p.read_text()))}
    assert len(files) > 100 and not found, f"machine paths in committed results (write them relative or as WORK/...): {found}"
