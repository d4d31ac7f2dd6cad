"""The README's Python examples run as written (on the CPU through Triton's interpreter)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, capsys):
    pytest.importorskip("transformers")
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})
