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


def cli_commands():
    """Every `python -m jaxllm.train|generate` command of the README's bash blocks, with
    shell variables set earlier in the same block substituted."""
    import shlex
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        env = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if m := re.fullmatch(r'(\w+)="(.*)"', line):
                env[m[1]] = m[2]
            elif line.startswith("python -m jaxllm."):
                for k, v in env.items():
                    line = line.replace(f"${k}", v)
                out.append(shlex.split(line)[2:])
    return out


PACKAGE_CLIS = ("jaxllm.train", "jaxllm.serve", "jaxllm.plan")  # CLIs in a package's __main__


def test_readme_commands_parse():
    """Each command's flags parse and its config with the overrides loads and checks
    (nothing is trained or loaded)."""
    import importlib

    from jaxllm.config import load_config
    cmds = cli_commands()
    assert len(cmds) >= 10
    for module, *argv in cmds:
        cli = importlib.import_module(module + ".__main__" if module in PACKAGE_CLIS
                                      else module)
        args = cli.build_parser().parse_args(argv)
        config = getattr(args, "config", None)
        if config is not None or module == "jaxllm.train":
            load_config(ROOT / config, args.overrides).check()
