"""``python -m dsv4_compile``: bad arguments and presets that do not fit end in one error line
before anything is allocated; ``--compile`` runs compile_step, says when it compiles and reports
compilation apart from tokens/s."""

import re
import subprocess
import sys

import pytest

import dsv4_compile.__main__ as cli


BAD = {
    "preset": (["--preset", "huge"], "--preset: unknown preset 'huge'"),
    "device name": (["--device", "gpu0"], "--device 'gpu0' is not a device name"),
    "device type": (["--device", "mps"], "only cpu and cuda"),
    "device index": (["--device", "cuda:7"], "--device 'cuda:7'"),
    "requests": (["--requests", "0"], "--requests must be >= 1"),
    "memory": (["--requests", "100000000"], "needs 2"),  # beyond any machine: refused before allocating
}


def _one_error_line(stderr: str, message: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("python -m dsv4_compile: error: ") and message in lines[0], lines[0]


@pytest.mark.parametrize("bad", ["preset", "memory"])
def test_bad_arguments_end_in_one_error_line_from_the_command(bad):
    args, message = BAD[bad]
    done = subprocess.run([sys.executable, "-m", "dsv4_compile", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    _one_error_line(done.stderr, message)


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_arguments_end_in_one_error_line(bad, capsys):
    args, message = BAD[bad]
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(err, message)


def test_memory_check_names_weights_and_cache(monkeypatch):
    monkeypatch.setattr(cli, "available_bytes", lambda device: 2**30)
    config = cli.DSV4AttnConfig.from_name("pro")
    with pytest.raises(cli.ArgumentError, match=r"--preset pro needs 36\.\d GiB on cpu \(weights 36\.\d GiB"):
        cli.check_memory("pro", config, cli.torch.device("cpu"), 3, 512)
    cli.check_memory("tiny", cli.DSV4AttnConfig.from_name("tiny"), cli.torch.device("cpu"), 3, 512)


def test_compile_runs_compile_step_and_times_compilation_apart(monkeypatch, capsys):
    """--compile goes through compile_step (here with the eager backend to stay fast) and prints
    that it compiles; tokens/s is over the steps' own time, compilation reported on its own line."""
    calls = []

    def compile_step(stack, **kwargs):
        calls.append(stack)
        return cli.compile_step.__wrapped__(stack, backend="eager", **kwargs)

    compile_step.__wrapped__ = cli.compile_step
    monkeypatch.setattr(cli, "compile_step", compile_step)
    assert cli.main(["--compile", "--requests", "2", "--prefill", "40", "--decode-steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert len(calls) == 1
    assert "compiling the step" in err and "compiled in" in err
    tokens_per_s = float(re.search(r"tokens/s: ([\d.]+) \(compilation excluded\)", out).group(1))
    compiled = re.search(r"compile: (\d+) compilations? in ([\d.]+) s", out)
    assert int(compiled.group(1)) >= 2 and tokens_per_s > 0
    assert "OK" in out
