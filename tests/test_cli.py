"""The zerojax command: shorter spellings resolve to the full commands."""
from zerojax._cli import _expand, build_parser, main


def test_single_command_groups_run_without_naming_the_command(capsys):
    assert main(["estimate", "--params", "7e9", "--devices", "8"]) == 0
    assert "stage 3" in capsys.readouterr().out


def test_aliases_and_explicit_commands():
    parser = build_parser()
    assert _expand(parser, ["consolidate", "ckpt", "out"]) == ["checkpoint", "consolidate", "ckpt", "out"]
    assert _expand(parser, ["estimate", "memory", "--params", "1e9"]) == ["estimate", "memory", "--params", "1e9"]
    assert _expand(parser, ["plan", "--help"]) == ["plan", "--help"]
    assert _expand(parser, ["config", "check", "x.json"]) == ["config", "check", "x.json"]
