"""The zerojax command: shorter spellings resolve to the full commands; ``python -m zerojax`` is
the command."""
import os
import subprocess
import sys

from tests.helpers import child_env
from zerojax._cli import _expand, build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_single_command_groups_run_without_naming_the_command(capsys):
    assert main(["estimate", "--params", "7e9", "--devices", "8"]) == 0
    assert "stage 3" in capsys.readouterr().out


def test_aliases_and_explicit_commands():
    parser = build_parser()
    assert _expand(parser, ["consolidate", "ckpt", "out"]) == ["checkpoint", "consolidate", "ckpt", "out"]
    assert _expand(parser, ["estimate", "memory", "--params", "1e9"]) == ["estimate", "memory", "--params", "1e9"]
    assert _expand(parser, ["plan", "--help"]) == ["plan", "--help"]
    assert _expand(parser, ["config", "check", "x.json"]) == ["config", "check", "x.json"]


def test_python_m_zerojax_runs_the_command():
    """``python -m zerojax launch`` reaches the launcher through the command (one child process)."""
    out = subprocess.run([sys.executable, "-m", "zerojax", "launch", "--help"], capture_output=True, text=True,
                         env=child_env(), cwd=ROOT, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: zerojax launch"), out.stdout
    assert "--devices-per-proc" in out.stdout
