"""``zerojax config check FILE``: a verdict for every key of the file (honoured, ignored,
warned-ignored or refused) and why; exit code 2 when anything is refused."""
import json
import pathlib
import re

import pytest

from zerojax._cli import main
from zerojax.config._deepspeed import key_report

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ds_configs"
CORPUS = pathlib.Path(__file__).parent / "ds_corpus"

MIXED = {
    "train_batch_size": 16,
    "_comment": "a note",
    "steps_per_print": 100,
    "comms_config": {"verbose": True},
    "train_batch_sizee": 3,
    "sparse_attention": {"mode": "fixed"},
    "zero_optimization": {"stage": 2, "cpu_offload": True, "contiguous_gradients": True,
                          "stage3_max_live_parameters": 5, "offload_param": {"device": "cpu"},
                          "zero_quantized_weights": True, "stagee": 1},
    "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
}


def leaf_paths(node, path=""):
    for key, value in node.items():
        sub = f"{path}.{key}" if path else key
        if isinstance(value, dict) and value:
            yield from leaf_paths(value, sub)
        else:
            yield sub


def run(tmp_path, capsys, cfg, *extra):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    code = main(["config", "check", str(path), "--world-size", "8", *extra])
    return code, capsys.readouterr()


def rows(out: str) -> dict:
    """{key path: (verdict, why)} from the printed report."""
    found, lines = {}, out.splitlines()
    for head, why in zip(lines[:-1:2], lines[1:-1:2]):
        kind, path = head.split()[:2]
        found[path] = (kind, why.strip())
    return found


def test_every_key_gets_a_verdict_and_the_reason(tmp_path, capsys):
    code, captured = run(tmp_path, capsys, MIXED)
    assert code == 2
    got = rows(captured.out)
    assert set(leaf_paths(MIXED)) <= set(got)
    expect = {
        "train_batch_size": ("honoured", "-> ZeroConfig.train_batch_size"),
        "_comment": ("ignored", "comment"),
        "steps_per_print": ("honoured", "read by zerojax.monitor"),
        "comms_config.verbose": ("warned-ignored", "not a DeepSpeed key"),
        "train_batch_sizee": ("warned-ignored", 'Did you mean "train_batch_size"?'),
        "sparse_attention.mode": ("refused", "was removed from DeepSpeed"),
        "zero_optimization.stage": ("honoured", "-> ZeroConfig.stage"),
        "zero_optimization.cpu_offload": ("honoured", 'deprecated spelling, read as "offload_optimizer"'),
        "zero_optimization.contiguous_gradients": ("honoured", "DeepSpeed's default"),
        "zero_optimization.stage3_max_live_parameters": ("warned-ignored", "only applies at ZeRO stage 3"),
        "zero_optimization.offload_param.device": ("warned-ignored", "needs ZeRO stage 3"),
        "zero_optimization.zero_quantized_weights": ("warned-ignored", "only applies at ZeRO stage 3"),
        "zero_optimization.stagee": ("refused", 'Did you mean "stage"?'),
        "optimizer.type": ("refused", "not available in zerojax"),
    }
    for path, (kind, why) in expect.items():
        assert got[path][0] == kind and why in got[path][1], (path, got[path])
    assert "comet" not in got["comms_config.verbose"][1]
    assert captured.out.splitlines()[-1] == "6 honoured, 1 ignored, 5 warned-ignored, 3 refused"


def test_a_clean_file_exits_0_and_auto_says_where_the_value_came_from(tmp_path, capsys):
    args = json.dumps({"per_device_train_batch_size": 2, "max_steps": 30, "bf16": True})
    code, captured = run(tmp_path, capsys, json.loads((EXAMPLES / "zero3_offload.json").read_text()),
                         "--hidden-size", "64", "--training-args", args)
    assert code == 0
    got = rows(captured.out)
    assert got["bf16.enabled"] == ("honoured", '-> ZeroConfig.precision; "auto": filled from training_args.bf16 = True')
    assert got["zero_optimization.reduce_bucket_size"][1].endswith("filled from hidden_size**2 = 4096")
    assert all(kind == "honoured" for kind, _ in got.values())
    assert re.fullmatch(r"\d+ honoured, 0 ignored, 0 warned-ignored, 0 refused", captured.out.splitlines()[-1])


def test_what_the_file_leaves_out_is_reported_when_it_matters(tmp_path, capsys):
    cfg = {"train_micro_batch_size_per_gpu": 4}
    code, captured = run(tmp_path, capsys, cfg, "--training-args", '{"per_device_train_batch_size": 4, '
                                                                    '"gradient_accumulation_steps": 2}')
    assert code == 2
    assert re.search(r"^refused +training_args \(not in the file\)$", captured.out, re.M)
    assert "gradient_accumulation_steps=1 (absent: derived by the batch rule)" in captured.out


def test_json_prints_the_resolved_config(tmp_path, capsys):
    code, captured = run(tmp_path, capsys, {"train_batch_size": 16, "zero_optimization": {"stage": 1}}, "--json")
    assert code == 0 and json.loads(captured.out)["stage"] == 1


def test_an_unreadable_file_is_an_error(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{")
    assert main(["config", "check", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(p.name for p in CORPUS.glob("*.json") if p.name != "verdicts.json")
                         + ["zero1.json", "zero2.json", "zero3_offload.json", "auto_template.json"])
def test_real_configs_get_a_verdict_for_every_key(name):
    path = CORPUS / name if (CORPUS / name).exists() else EXAMPLES / name
    raw = json.loads(path.read_text())
    report = key_report(path, world_size=8, hidden_size=64)
    in_file = [r for r in report if r.in_file]
    assert [r.path for r in in_file] == list(leaf_paths(raw))
    assert all(r.why != "not read by zerojax" for r in in_file), [r.path for r in in_file if r.why == "not read by zerojax"]
    assert {r.kind for r in report} <= {"honoured", "ignored", "warned-ignored", "refused"}
