"""The README's Python snippets run as written (each in a fresh namespace, in a scratch
directory that sees the repository's configs/)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Hugging Face needs a downloaded model directory (tests/test_hf.py covers the same API).
SKIP_SECTIONS = {"Hugging Face checkpoints"}


def python_snippets():
    out, section = [], None
    for part in re.split(r"^(## .*)$", (ROOT / "README.md").read_text(), flags=re.M):
        if part.startswith("## "):
            section = part[3:].strip()
        elif section not in SKIP_SECTIONS:
            out += [(section, code) for code in re.findall(r"```python\n(.*?)```", part, re.S)]
    return out


def test_snippets_are_found():
    assert {"Generation", "Python API"} <= {s for s, _ in python_snippets()}


@pytest.mark.parametrize("section,code", python_snippets(),
                         ids=[s for s, _ in python_snippets()])
def test_readme_snippet_runs(section, code, tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md ({section})", "exec"), {"__name__": "readme"})
