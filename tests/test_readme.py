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


@pytest.mark.parametrize("args, message", [(["--steps", "3"], "at least 10 steps"),
                                           (["--steps", "-1"], "at least 10 steps"),
                                           (["--out", "/nonexistent/folder/plot.png"], "is not a folder")])
def test_demo_refuses_bad_options_before_it_trains(args, message, capsys):
    """The README's first command: options that cannot work are refused at once, not after the training."""
    from codetta.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err
