"""DeepSpeed's own verdict on every config in tests/config/ds_corpus/.

Run it with the python of a separate environment that has DeepSpeed (never zerojax's):

    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/ds_verdicts.py

For each file it fills "auto" the way Hugging Face's Trainer does (``HfTrainerDeepSpeedConfig``:
trainer_config_process + trainer_config_finalize; only keys whose value is "auto" are replaced,
absent keys stay absent), plus accelerate's fill of
``stage3_gather_16bit_weights_on_model_save`` from ``zero3_save_16bit_model``, then hands the
dict to ``deepspeed.runtime.config.DeepSpeedConfig`` with a data-parallel world size of
WORLD_SIZE (given through an ``mpu`` object; no process group is created). It writes
tests/config/ds_corpus/verdicts.json: ``{file: {"accepts", "error", "deepspeed_version",
"training_args", "sha256"}}`` (the sha256 of the file's bytes, so that a stale table is
noticed) and a ``_header`` entry recording the rules below. DeepSpeed drops any "auto" left
inside its pydantic blocks and uses the default there, so such a leftover is not a rejection.

The training arguments are derived per file so that they agree with the file's explicit
values (the test drives zerojax with the same ones, read from the table):

* per_device_train_batch_size: the file's train_micro_batch_size_per_gpu if it is a number,
  else train_batch_size // (WORLD_SIZE * GAS) (at least 1) if that is a number, else 2;
* gradient_accumulation_steps: the file's value if a number, else train_batch_size //
  (micro * WORLD_SIZE) (at least 1) when both of those are numbers, else 1;
* learning_rate: optimizer.params.lr if a number; DeepSpeed's default 1e-3 when an optimizer
  block has no lr; else scheduler.params.warmup_max_lr if a number; else 1e-4;
* adam_beta1/2, adam_epsilon: optimizer.params.betas / eps if numbers, else 0.9, 0.999, 1e-8;
* weight_decay: optimizer.params.weight_decay if a number; 0.01 when it is "auto"; else 0.0;
* max_grad_norm: gradient_clipping if a number, else 1.0 (DeepSpeed's default);
* warmup_steps / max_steps: scheduler warmup_num_steps / total_num_steps if numbers, else 2 / 10;
* bf16: bf16.enabled if a bool; True when it is "auto" and fp16 is not explicitly enabled;
  fp16: fp16.enabled if a bool; True when it is "auto" and bf16 is off; absent blocks are off;
* hidden_size HIDDEN_SIZE fills reduce_bucket_size (h*h), and at stage 3
  stage3_prefetch_bucket_size (int(0.9*h*h)) and stage3_param_persistence_threshold (10*h);
* zero3_save_16bit_model False (accelerate's default).
"""
from __future__ import annotations

import copy
import glob
import hashlib
import json
import numbers
import os
import platform
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime import config as ds_config_module  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, os.pardir, "tests", "config", "ds_corpus")
WORLD_SIZE = 8
HIDDEN_SIZE = 20
DEFAULT_MICRO_BATCH = 2
DEFAULT_LR = 1e-4
DEEPSPEED_DEFAULT_LR = 1e-3
AUTO_WEIGHT_DECAY = 0.01
DEFAULT_WARMUP_STEPS = 2
DEFAULT_MAX_STEPS = 10
ZERO3_SAVE_16BIT_MODEL = False


class DataParallelOnly:
    """The ``mpu`` DeepSpeedConfig asks for the data-parallel world size."""

    def get_data_parallel_world_size(self):
        return WORLD_SIZE


def _num(value) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


def _get(cfg: dict, path: str):
    node = cfg
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def training_args_for(cfg: dict) -> dict:
    """The Hugging Face TrainingArguments (names as in transformers) this file is run with."""
    tb, mb, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))
    if _num(gas):
        gas = int(gas)
    elif _num(tb) and _num(mb):
        gas = max(1, int(tb) // (int(mb) * WORLD_SIZE))
    else:
        gas = 1
    if _num(mb):
        mb = int(mb)
    elif _num(tb):
        mb = max(1, int(tb) // (WORLD_SIZE * gas))
    else:
        mb = DEFAULT_MICRO_BATCH

    opt = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), dict) else None
    params = (opt or {}).get("params") or {}
    if _num(params.get("lr")):
        lr = float(params["lr"])
    elif opt is not None and "lr" not in params:
        lr = DEEPSPEED_DEFAULT_LR
    elif _num(_get(cfg, "scheduler.params.warmup_max_lr")):
        lr = float(_get(cfg, "scheduler.params.warmup_max_lr"))
    else:
        lr = DEFAULT_LR
    betas = params.get("betas")
    b1, b2 = (float(betas[0]), float(betas[1])) if isinstance(betas, list) and all(map(_num, betas)) else (0.9, 0.999)
    eps = float(params["eps"]) if _num(params.get("eps")) else 1e-8
    wd = params.get("weight_decay")
    wd = float(wd) if _num(wd) else (AUTO_WEIGHT_DECAY if wd == "auto" else 0.0)
    clip = cfg.get("gradient_clipping")
    clip = float(clip) if _num(clip) else 1.0
    warm = _get(cfg, "scheduler.params.warmup_num_steps")
    total = _get(cfg, "scheduler.params.total_num_steps")

    fp16_v = _get(cfg, "fp16.enabled")
    bf16_v = _get(cfg, "bf16.enabled") if "bf16" in cfg else _get(cfg, "bfloat16.enabled")
    bf16 = bf16_v if isinstance(bf16_v, bool) else (bf16_v == "auto" and fp16_v is not True)
    fp16 = fp16_v if isinstance(fp16_v, bool) else (fp16_v == "auto" and not bf16)
    return {
        "per_device_train_batch_size": mb,
        "gradient_accumulation_steps": gas,
        "learning_rate": lr,
        "adam_beta1": b1,
        "adam_beta2": b2,
        "adam_epsilon": eps,
        "weight_decay": wd,
        "max_grad_norm": clip,
        "warmup_steps": int(warm) if _num(warm) else DEFAULT_WARMUP_STEPS,
        "warmup_ratio": 0.0,
        "max_steps": int(total) if _num(total) else DEFAULT_MAX_STEPS,
        "fp16": bool(fp16),
        "bf16": bool(bf16),
    }


def _fill(cfg: dict, path: str, value) -> None:
    """Hugging Face's fill_match/fill_only: replace the value only where it is "auto"."""
    *parents, key = path.split(".")
    node = cfg
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict) and node.get(key) == "auto":
        node[key] = value


def fill_auto(raw: dict, args: dict) -> dict:
    cfg = copy.deepcopy(raw)
    mb, gas = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
    _fill(cfg, "train_micro_batch_size_per_gpu", mb)
    _fill(cfg, "gradient_accumulation_steps", gas)
    _fill(cfg, "train_batch_size", WORLD_SIZE * mb * gas)
    _fill(cfg, "gradient_clipping", args["max_grad_norm"])
    _fill(cfg, "optimizer.params.lr", args["learning_rate"])
    _fill(cfg, "optimizer.params.betas", [args["adam_beta1"], args["adam_beta2"]])
    _fill(cfg, "optimizer.params.eps", args["adam_epsilon"])
    _fill(cfg, "optimizer.params.weight_decay", args["weight_decay"])
    _fill(cfg, "scheduler.params.warmup_min_lr", 0)
    _fill(cfg, "scheduler.params.warmup_max_lr", args["learning_rate"])
    _fill(cfg, "scheduler.params.warmup_num_steps", args["warmup_steps"])
    _fill(cfg, "scheduler.params.total_num_steps", args["max_steps"])
    _fill(cfg, "fp16.enabled", args["fp16"])
    _fill(cfg, "bf16.enabled", args["bf16"])  # Hugging Face fills "bf16", not the old "bfloat16"
    _fill(cfg, "zero_optimization.reduce_bucket_size", HIDDEN_SIZE * HIDDEN_SIZE)
    if _get(cfg, "zero_optimization.stage") == 3:
        _fill(cfg, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * HIDDEN_SIZE * HIDDEN_SIZE))
        _fill(cfg, "zero_optimization.stage3_param_persistence_threshold", 10 * HIDDEN_SIZE)
        _fill(cfg, "zero_optimization.stage3_gather_16bit_weights_on_model_save", ZERO3_SAVE_16BIT_MODEL)
    return cfg


def verdict(raw: dict) -> tuple[bool, str | None]:
    try:
        ds_config_module.DeepSpeedConfig(raw, mpu=DataParallelOnly())
    except Exception as e:  # noqa: BLE001 - any exception is DeepSpeed saying no
        return False, f"{type(e).__name__}: {e}"[:1500]
    return True, None


def main() -> int:
    ds_config_module.dist.get_rank = lambda *a, **k: 0  # no process group: rank 0
    header = {
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "world_size": WORLD_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "auto_fill": "Hugging Face Trainer (only values that are \"auto\"; bf16.enabled but not bfloat16.enabled; "
                     "hidden-size keys: reduce_bucket_size always, the stage3_ ones at stage 3) plus accelerate's "
                     "stage3_gather_16bit_weights_on_model_save <- zero3_save_16bit_model=False",
        "training_args": {
            "per_device_train_batch_size": f"file's micro batch, else train_batch_size // (world*GAS), else "
                                           f"{DEFAULT_MICRO_BATCH}",
            "gradient_accumulation_steps": "file's value, else train_batch_size // (micro*world), else 1",
            "learning_rate": f"optimizer lr, else {DEEPSPEED_DEFAULT_LR} (optimizer block without lr), else "
                             f"scheduler warmup_max_lr, else {DEFAULT_LR}",
            "adam_beta1/adam_beta2/adam_epsilon": "file's betas/eps, else 0.9/0.999/1e-8",
            "weight_decay": f"file's value, {AUTO_WEIGHT_DECAY} for \"auto\", else 0.0",
            "max_grad_norm": "file's gradient_clipping, else 1.0",
            "warmup_steps/max_steps": f"file's scheduler values, else {DEFAULT_WARMUP_STEPS}/{DEFAULT_MAX_STEPS}",
            "bf16/fp16": "file's bools; \"auto\" -> bf16 unless fp16 is explicitly on; fp16 \"auto\" -> on "
                         "when bf16 is off",
        },
    }
    table = {"_header": header}
    for path in sorted(glob.glob(os.path.join(CORPUS, "*.json"))):
        name = os.path.basename(path)
        if name == "verdicts.json":
            continue
        with open(path, "rb") as f:
            data = f.read()
        raw = json.loads(data)
        args = training_args_for(raw)
        accepts, error = verdict(fill_auto(raw, args))
        table[name] = {"accepts": accepts, "error": error, "deepspeed_version": deepspeed.__version__,
                       "training_args": args, "sha256": hashlib.sha256(data).hexdigest()}
        print(f"{'accepts' if accepts else 'REJECTS'}  {name}" + (f"\n    {error.splitlines()[0]}" if error else ""))
    out = os.path.join(CORPUS, "verdicts.json")
    with open(out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {os.path.normpath(out)}: {sum(v['accepts'] for k, v in table.items() if k != '_header')} of "
          f"{len(table) - 1} accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
