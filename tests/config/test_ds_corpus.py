"""Real public DeepSpeed configs (tests/config/ds_corpus/, sources in SOURCES) through
zj.initialize and three steps, held to DeepSpeed's own verdict on each.

verdicts.json is DeepSpeed 0.19's answer (``DeepSpeedConfig(dict)`` at world size 8, after
Hugging Face's "auto" fill), written by benchmarks/ds_verdicts.py in a separate environment;
it also records the training arguments each file is run with (they agree with the file's
explicit values). The expectation per file:

* DeepSpeed accepts it: it trains on 8 devices (finite loss, step counter 3), except that a
  DeepSpeed-only optimizer (OneBitAdam, OneBitLamb, ZeroOneAdam) is refused with a
  ConfigError naming the optimizer, and params offloaded to NVMe at stage 3 without the
  optimizer there too (``offload_param.device`` "nvme": the params live in the NVMe optimizer's
  files) with one naming ``zero_optimization.offload_param.device``; a file with AutoTP (``tensor_parallel``) trains on the
  ("data", "model") mesh zj.initialize builds for it;
* DeepSpeed rejects it: zj.initialize raises a ConfigError.

A file is used as it is, except that every ``nvme_path`` is pointed at a temporary directory
(the test passes the copied dict instead of the path then); nothing else in a file is changed.
The model is tests.helpers' tiny one; its params are made once and passed to zj.initialize in
place of the init function, so each file costs one compile (its step).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import warnings

import jax
import numpy as np
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn
from zerojax._errors import ConfigError, IgnoredKeysWarning

CORPUS = pathlib.Path(__file__).parent / "ds_corpus"
TABLE = json.loads((CORPUS / "verdicts.json").read_text())
HEADER = TABLE["_header"]
FILES = sorted(p.name for p in CORPUS.glob("*.json") if p.name != "verdicts.json")
DEEPSPEED_ONLY_OPTIMIZERS = ("onebitadam", "onebitlamb", "zerooneadam")
STEPS = 3

# Files whose expectation zerojax does not meet yet, with the cause; strict, so a file that
# starts passing fails here until it is taken off the list.
XFAIL: dict[str, str] = {}


@functools.lru_cache(maxsize=1)
def _params():
    """The tiny model's params as host arrays (made once for every file)."""
    return jax.tree_util.tree_map(np.asarray, init_params(jax.random.PRNGKey(0)))


def _refusal(cfg: dict):
    """The name a ConfigError must carry for a setting zerojax refuses, or None."""
    opt = cfg.get("optimizer")
    if isinstance(opt, dict) and str(opt.get("type", "")).lower() in DEEPSPEED_ONLY_OPTIMIZERS:
        return str(opt["type"])
    zero = cfg.get("zero_optimization")
    param = zero.get("offload_param") if isinstance(zero, dict) else None
    opt_block = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if isinstance(param, dict) and param.get("device") == "nvme" and zero.get("stage") == 3 and not (
            isinstance(opt_block, dict) and opt_block.get("device") == "nvme"):
        return "zero_optimization.offload_param.device"
    return None


def _with_nvme_dir(cfg: dict, directory: pathlib.Path):
    """A copy with every offload block's nvme_path set to a directory under ``directory`` (one per
    distinct path of the file), or None if it has none."""
    zero = cfg.get("zero_optimization")
    blocks = [k for k, v in zero.items() if isinstance(v, dict) and "nvme_path" in v] if isinstance(zero, dict) else []
    if not blocks:
        return None
    cfg = copy.deepcopy(cfg)
    distinct = sorted({str(cfg["zero_optimization"][key]["nvme_path"]) for key in blocks})
    for key in blocks:
        cfg["zero_optimization"][key]["nvme_path"] = str(directory / f"nvme{distinct.index(str(cfg['zero_optimization'][key]['nvme_path']))}")
    return cfg


def test_table_covers_the_corpus():
    assert FILES and len(FILES) >= 40
    assert sorted(k for k in TABLE if not k.startswith("_")) == FILES, "rerun benchmarks/ds_verdicts.py"
    for name in FILES:
        digest = hashlib.sha256((CORPUS / name).read_bytes()).hexdigest()
        assert TABLE[name]["sha256"] == digest, f"{name} changed since its verdict: rerun benchmarks/ds_verdicts.py"
        assert TABLE[name]["deepspeed_version"].startswith("0.19")
    sources = [line.split()[0] for line in (CORPUS / "SOURCES").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert sorted(sources) == FILES
    contents = {json.dumps(json.loads((CORPUS / n).read_text()), sort_keys=True) for n in FILES}
    assert len(contents) == len(FILES), "two corpus files hold the same config"
    assert set(XFAIL) <= set(FILES)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n]))
                                  if n in XFAIL else n for n in FILES])
def test_corpus_file(name, tmp_path):
    verdict = TABLE[name]
    path = CORPUS / name
    raw = json.loads(path.read_text())
    config = _with_nvme_dir(raw, tmp_path) or path
    args = zj.TrainingArgs(**verdict["training_args"])
    if "tensor_parallel" in raw:  # AutoTP on the CPU backend trains in fp32 (zerojax._autotp.check_cpu_precision)
        args = dataclasses.replace(args, bf16=False, fp16=False)

    def initialize():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IgnoredKeysWarning)
            mesh = None if "tensor_parallel" in raw else zj.make_mesh()  # AutoTP: initialize builds it
            return zj.initialize(_params(), loss_fn, config, mesh=mesh, training_args=args,
                                 hidden_size=HEADER["hidden_size"])

    refused = _refusal(raw)
    if not verdict["accepts"] or refused:
        with pytest.raises(ConfigError) as info:
            initialize()
        if verdict["accepts"]:
            assert refused.lower() in str(info.value).lower(), (
                f"the refusal does not name {refused!r}: {info.value}")
        return

    state, step = initialize()
    with step:
        tb = step.train_batch_size or HEADER["world_size"] * args.per_device_train_batch_size * \
            args.gradient_accumulation_steps
        losses = []
        for batch in batches(STEPS, batch_size=tb):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        state = step.finish(state)
    assert all(math.isfinite(x) for x in losses), losses
    assert int(state.step) == STEPS
