"""The README's Python examples run as written (on the CPU through Triton's interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import codetta

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
                                           (["--steps", "abc"], "must be an integer"),
                                           (["--out", "/nonexistent/folder/plot.png"], "is not a folder"),
                                           (["--out", "{tmp}"], "is a folder, not a file name"),
                                           (["--out", ""], "file name is empty"),
                                           (["--out", "{tmp}/plot.foo"], "must end in one of"),
                                           (["--out", "/proc/codetta_plot.png"], "cannot be written")])
def test_demo_refuses_bad_options_before_it_trains(args, message, capsys, tmp_path):
    """The README's first command: options that cannot work are refused at once, not after the training."""
    from codetta.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", *(a.format(tmp=tmp_path) for a in args)])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # the writability check leaves nothing behind


def test_cli_version(capsys):
    from codetta.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"codetta {codetta.__version__}"


ROOT = README.parent


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["bogus"], 2), ([], 2)])
def test_run_sh_says_its_usage_before_any_setup(args, code, tmp_path):
    """./run.sh with no or unknown arguments prints its usage at once (no environment is made)."""
    result = subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == code
    assert "usage: ./run.sh demo" in result.stdout + result.stderr


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="run.sh's environment is not set up")
def test_run_sh_test_with_options_only_runs_codettas_tests_from_any_folder(tmp_path):
    """`run.sh test -k name` from another folder collects codetta's tests, not that folder's (also
    where that folder holds a file named as the option's value); a path given is taken as given."""
    (tmp_path / "test_stray.py").write_text("def test_stray():\n    pass\n")
    (tmp_path / "test_the_readme_has_examples").write_text("")

    def collected(*args):
        result = subprocess.run(["bash", str(ROOT / "run.sh"), "test", "--collect-only", "-p", "no:cacheprovider",
                                 *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        return result.returncode, result.stdout

    code, out = collected("-k", "test_the_readme_has_examples")
    assert code == 0 and "test_readme.py" in out and "test_stray" not in out, out
    code, out = collected("test_stray.py")
    assert code == 0 and "test_stray" in out and "test_readme" not in out, out


def test_triton_interpret_read_as_triton_reads_it():
    code = "from codetta.interpreter import interpreting; print(interpreting())"
    for value, expected in (("true", "True"), ("on", "True"), ("1", "True"), ("0", "False")):
        env = {**os.environ, "TRITON_INTERPRET": value, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expected, (value, out.stderr[-500:])


def test_nn_is_an_attribute_of_the_package():
    """The README's codetta.nn.Decoder after a plain ``import codetta``."""
    assert codetta.nn.Decoder is not None
