"""The docs name paths that exist and cite design sections that exist.

Path rule, used by every check below: a backticked path resolves against the repository root
first (`dflash_ds/runtime/step.py`, `launch/gpu_check.sh`, `docs/DESIGN.md`) and, when it does
not exist there, against the package folder `dflash_ds/` (`runtime/step.py`, `models/`,
`config.py`). A `path.py:name` suffix names a symbol and is dropped; `pkg/module.attr`, with
`pkg` a package folder, names module `pkg/module.py`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dflash_ds"
DESIGN = ROOT / "docs" / "DESIGN.md"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SUBPACKAGES = {p.name for p in PKG.iterdir() if p.is_dir() and any(p.glob("*.py"))}
TOP_DIRS = {"dflash_ds", "docs", "tests", "launch", "configs", "ds_configs"}
FILE_EXTS = (".py", ".sh", ".md", ".json", ".yaml", ".toml")
# Built, not written out, so this file does not cite what it forbids.
OLD_CITATION = re.compile(r"(?<!docs/)DESIGN(?:\.md)? " + "\u00a7")
CITATION = re.compile(r"docs/DESIGN\.md \u00a7(\d+)")


def resolve(name: str) -> Path | None:
    """The file or folder a doc's path names (root first, then dflash_ds/), or None."""
    name = name.split(":", 1)[0]
    for base in (ROOT, PKG):
        if (base / name).exists():
            return base / name
    return None


def inline_code(text: str) -> list[str]:
    """Backticked spans outside fenced code blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [re.sub(r"\s*\n\s*", " ", span) for span in re.findall(r"`([^`]+)`", prose)]


def section(text: str, title: str) -> str:
    """The body of the `## title` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"no '## {title}' section"
    return match.group(1)


def repo_text_files() -> list[Path]:
    """Tracked files plus new ones git does not ignore (what the next commit can hold), text only."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for rel in out.splitlines():
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        files.append(path)
    return files


def test_readme_layout_names_existing_paths():
    layout = section((ROOT / "README.md").read_text(), "Layout")
    names = [t for t in inline_code(layout) if "/" in t or t.endswith(FILE_EXTS)]
    assert len(names) >= 10, names
    missing = [n for n in names if resolve(n) is None]
    assert not missing, f"README's Layout names paths that do not exist (root or dflash_ds/): {missing}"


def test_no_citation_of_the_outside_design_document():
    hits = []
    for path in repo_text_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OLD_CITATION.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not hits, "cite docs/DESIGN.md \u00a7N instead:\n" + "\n".join(hits)


def test_design_has_every_cited_section():
    assert DESIGN.exists()
    headings = [int(n) for n in re.findall(r"^## (\d+)\. ", DESIGN.read_text(), flags=re.M)]
    assert headings == list(range(1, 10)), headings
    cited: dict[int, list[str]] = {}
    for path in repo_text_files():
        for n in CITATION.findall(path.read_text(errors="replace")):
            cited.setdefault(int(n), []).append(str(path.relative_to(ROOT)))
    assert cited, "nothing cites docs/DESIGN.md"
    absent = {n: where for n, where in cited.items() if n not in headings}
    assert not absent, f"cited sections missing from docs/DESIGN.md: {absent}"


def code_paths(token: str) -> str | None:
    """The repository path a backticked span names, if it names one of ours (see the module docstring)."""
    token = token.split(":", 1)[0].rstrip(".,;")
    if "/" not in token or re.search(r"[\s{}*<>]", token):
        return None
    first = token.split("/", 1)[0]
    if first not in TOP_DIRS and first not in SUBPACKAGES:
        return None
    if token.endswith(FILE_EXTS) or token.endswith("/"):
        return token
    module = re.fullmatch(r"([\w/]+)\.\w+", token)  # pkg/module.attr
    if module and first in SUBPACKAGES:
        return module.group(1) + ".py"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_paths_exist(doc):
    names = sorted({p for t in inline_code(doc.read_text()) if (p := code_paths(t))})
    missing = [n for n in names if resolve(n) is None]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_architecture_module_map_names_existing_modules():
    """Each bullet of the module map names a folder of dflash_ds/ and bare module names inside it."""
    body = section((ROOT / "docs" / "ARCHITECTURE.md").read_text(), "Module map: the folders are the architecture")
    missing, folders = [], 0
    for bullet in re.split(r"^- ", body, flags=re.M)[1:]:
        folder = re.match(r"\*\*`(\w+)/`\*\*", bullet)
        base = PKG / folder.group(1) if folder else PKG  # "Top level": dflash_ds/ itself
        folders += bool(folder)
        assert base.is_dir(), base
        missing += [str(base.relative_to(ROOT) / m) for m in inline_code(bullet)
                    if re.fullmatch(r"\w+\.py", m) and not (base / m).exists()]
    assert folders >= 8 and not missing, (folders, missing)


def test_every_package_py_path_in_docs_exists():
    missing = []
    for doc in DOCS:
        for path in re.findall(r"`(dflash_ds/[\w/]+\.py)", doc.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_readme_serving_lines_are_the_default_exports(tiny_target: Path, tmp_path: Path, capsys) -> None:
    """README's `vllm serve` lines are what `init-drafter` prints for a default export of each kind (the draft length
    its block trains: DSpark's 7, not DFlash's 15), so a user copying them never drafts into untrained slots."""
    import json

    from dflash_ds.cli import main

    fenced = re.findall(r"^```bash\n(.*?)^```", section((ROOT / "README.md").read_text(), "Serving your drafter"),
                        flags=re.S | re.M)
    readme = {json.loads(m)["method"]: json.loads(m) for block in fenced
              for m in re.findall(r"--speculative-config '(\{.*?\})'", block)}
    assert set(readme) == {"dflash", "dspark"}, readme
    for kind in ("dflash", "dspark"):
        out = tmp_path / kind
        assert main(["init-drafter", "--target", str(tiny_target), "--out", str(out), "--kind", kind,
                     "--num-layers", "1"]) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("serve: "))
        printed = json.loads(re.search(r"--speculative-config '(\{.*\})'", line).group(1))
        assert printed == {**readme[kind], "model": str(out)}, (kind, line)
        assert line.startswith("serve: VLLM_USE_V2_MODEL_RUNNER=1 " if kind == "dspark" else "serve: vllm serve ")
