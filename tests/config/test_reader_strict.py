"""The DeepSpeed reader refuses what DeepSpeed refuses: duplicate keys at any depth, and a file
that is not UTF-8 text is a ConfigError naming the file (never a raw decoding error)."""
import json

import pytest

import zerojax as zj
from zerojax.config._deepspeed import read_deepspeed

BASE = '{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}'


@pytest.mark.parametrize("text,dotted", [
    # the second block would win under a plain json.load: stage 0 instead of stage 3 + param offload
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, '
     '"zero_optimization": {"stage": 0}}', "zero_optimization"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage": 1}}', "zero_optimization.stage"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", '
     '"device": "none"}}}', "zero_optimization.offload_param.device"),
])
def test_duplicate_keys_are_refused_naming_the_key_and_file(tmp_path, text, dotted):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(zj.ConfigError, match="Duplicate keys in DeepSpeed config") as info:
        zj.ZeroConfig.from_deepspeed(str(path), world_size=8)
    assert f"'{dotted}'" in str(info.value) and str(path) in str(info.value)


def test_the_same_file_without_duplicates_reads(tmp_path):
    """The control: the first block alone gives stage 3 with param offload."""
    path = tmp_path / "ds_config.json"
    path.write_text(BASE)
    config = zj.ZeroConfig.from_deepspeed(str(path), world_size=8)
    assert config.stage == 3 and config.offload_param == "cpu"


def test_same_key_in_different_objects_is_not_a_duplicate(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": false}, "bf16": {"enabled": true}}')
    assert zj.ZeroConfig.from_deepspeed(str(path), world_size=8).precision == "bf16"


def test_latin1_file_is_a_config_error_naming_file_and_encoding(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_bytes('{"train_batch_size": 8, "_comment": "r\u00e9glage"}'.encode("latin-1"))
    with pytest.raises(zj.ConfigError, match="not UTF-8") as info:
        read_deepspeed(str(path), world_size=8)
    assert str(path) in str(info.value) and "0xe9" in str(info.value)
    # the same text in UTF-8 (with or without a byte-order mark) reads
    for data in (json.dumps({"train_batch_size": 8, "_comment": "r\u00e9glage"}).encode(),
                 b"\xef\xbb\xbf" + b'{"train_batch_size": 8}'):
        path.write_bytes(data)
        assert zj.ZeroConfig.from_deepspeed(str(path), world_size=8).stage == 0


@pytest.mark.parametrize("content", ["", "{", '["train_batch_size"]', '{"a": 1,}'])
def test_broken_json_is_a_config_error(tmp_path, content):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    with pytest.raises(zj.ConfigError, match="ds_config.json"):
        zj.ZeroConfig.from_deepspeed(str(path), world_size=8)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(zj.ConfigError, match="nope.json"):
        zj.ZeroConfig.from_deepspeed(str(tmp_path / "nope.json"), world_size=8)
