"""The README's quick starts run as they are written (copied out of README.md)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_starts() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Quick start") : text.index("## API")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_has_the_quick_starts():
    assert len(quick_starts()) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("index", [0, 1, 2])
def test_quick_start_runs(index, capsys):
    exec(compile(quick_starts()[index], f"README quick start {index}", "exec"), {})
    assert "torch.Size([" in capsys.readouterr().out
