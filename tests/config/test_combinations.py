"""Every combination of DeepSpeed's ZeRO settings trains or is refused by name.

A tiny language model (vocab 64, width 32: an embedding, one square layer, a head) goes through
``zj.initialize`` from DeepSpeed dicts, 3 steps on 8 devices, for each cell of stage {0, 1, 2, 3}
x offload_optimizer {none, cpu, nvme} x offload_param {none, cpu, nvme} (only at stage 3, where
DeepSpeed reads it) x precision {fp32, bf16}, and a few extras (gradient accumulation, fp16,
ZeRO++, ZenFlow). A cell either

* trains: fp32 params after 3 steps equal stage 0's (the same config without partitioning or
  offload) within 1e-6; losses are finite (all a bf16, fp16, ZeRO++ or ZenFlow cell is held
  to, as those change the numbers); the params live in the memory the
  config asked for (pinned host memory with offload_param "cpu", device memory otherwise) and
  an NVMe optimizer has committed its state under nvme_path; or
* is refused with a ``zj.ZeroJaxError`` whose message names the key at fault (:func:`refusal`).

Any other exception fails the cell. At stage 3 the persistence threshold (1500 elements) keeps
the 32 x 32 layer whole and partitions the embedding and the head, so both kinds of stage-3
param are offloaded. The quick tier runs the cells in QUICK (2 s); the whole grid is slow (47
cells, 15 s on an idle machine).
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import warnings
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
import zerojax._placement as placement
from zerojax._errors import IgnoredKeysWarning

VOCAB, D, SEQ, STEPS = 64, 32, 8, 3
THRESHOLD = 1500  # stage 3: the 64 x 32 embedding and head are partitioned, the 32 x 32 layer kept whole


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k1, (VOCAB, D)) * 0.3, "mlp": jax.random.normal(k2, (D, D)) * 0.3,
            "head": jax.random.normal(k3, (D, VOCAB)) * 0.3}


def loss_fn(params, batch):
    x = params["embed"][batch["tok"]]
    h = jnp.tanh(x @ params["mlp"].astype(x.dtype))
    logits = (h @ params["head"].astype(x.dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@functools.lru_cache(maxsize=1)
def _params():
    """The params as host arrays, made once and passed to zj.initialize in place of an init function."""
    return jax.tree_util.tree_map(np.asarray, init_params(jax.random.PRNGKey(0)))


def _batches(rows: int):
    rng = np.random.default_rng(0)
    return [{"tok": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32),
             "y": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32)} for _ in range(STEPS)]


class Cell(NamedTuple):
    stage: int
    optimizer: Optional[str] = None  # offload_optimizer.device
    param: Optional[str] = None  # offload_param.device
    precision: str = "fp32"
    gas: int = 1
    zeropp: bool = False
    zenflow: bool = False

    @property
    def id(self) -> str:
        extras = (f"-gas{self.gas}" if self.gas > 1 else "") + ("-zeropp" if self.zeropp else "") + \
            ("-zenflow" if self.zenflow else "")
        return f"s{self.stage}-opt_{self.optimizer or 'none'}-param_{self.param or 'none'}-{self.precision}{extras}"


def ds_config(cell: Cell, nvme_dir: str) -> dict:
    zo: dict = {"stage": cell.stage}
    if cell.stage == 3:
        zo["stage3_param_persistence_threshold"] = THRESHOLD
    for key, device in (("offload_optimizer", cell.optimizer), ("offload_param", cell.param)):
        if device is not None:
            zo[key] = {"device": device, **({"nvme_path": nvme_dir} if device == "nvme" else {})}
    if cell.zeropp:
        zo.update(zero_quantized_weights=True, zero_hpz_partition_size=2, zero_quantized_gradients=True)
    if cell.zenflow:
        zo["zenflow"] = {"topk_ratio": 0.25, "update_interval": 2}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": cell.gas, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": zo}
    if cell.precision != "fp32":
        cfg[cell.precision] = {"enabled": True}
    return cfg


def refusal(cell: Cell) -> Optional[str]:
    """The key a cell's ConfigError must name, or None where the cell trains."""
    if cell.stage == 0 and cell.optimizer is not None:  # offload moves the partitioned optimizer state
        return "zero_optimization.offload_optimizer.device"
    if cell.param == "nvme" and cell.optimizer != "nvme":  # params on NVMe live in the NVMe optimizer's files
        return "zero_optimization.offload_param.device"
    if cell.optimizer == "nvme" and cell.precision == "fp16":  # the NVMe step has no loss scaler
        return "offload_optimizer"
    return None


class Run(NamedTuple):
    state: object
    params: list  # fp32 leaves in the user's shapes, flatten order
    losses: list


def train(cell: Cell, nvme_dir: str) -> Run:
    cfg = ds_config(cell, nvme_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)  # ZeRO++ below stage 3 and the like
        state, step = zj.initialize(_params(), loss_fn, cfg, mesh=zj.make_mesh())
    losses = []
    with step:
        for batch in _batches(step.train_batch_size):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        state = step.finish(state)
        if cell.param == "nvme":  # the state holds the params' shapes; the params are in files
            params = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(step.full_params())]
        else:
            params = [np.asarray(x, np.float32) for x in placement.params_logical(state.plan, state.params)]
    return Run(state, params, losses)


@functools.lru_cache(maxsize=None)
def reference(gas: int) -> Run:
    """Stage 0, no offload, fp32: the params every fp32 cell must end with."""
    return train(Cell(0, gas=gas), "")


def check_cell(cell: Cell, tmp_path) -> None:
    nvme_dir = str(tmp_path / "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    key = refusal(cell)
    if key is not None:
        with pytest.raises(zj.ZeroJaxError) as info:
            train(cell, nvme_dir)
        assert key in str(info.value), f"{cell.id}: the refusal does not name {key}: {info.value}"
        assert "Fix" in str(info.value), str(info.value)
        return

    run = train(cell, nvme_dir)
    assert int(run.state.step) == STEPS
    assert all(math.isfinite(x) for x in run.losses), (cell.id, run.losses)

    # the params live where the config put them
    leaves = jax.tree_util.tree_leaves(run.state.params)
    kinds = {x.sharding.memory_kind for x in leaves}
    if cell.param == "nvme":  # nothing of the params in memory between steps: shapes only
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), f"{cell.id}: params held in memory"
    elif cell.param == "cpu":
        assert kinds == {"pinned_host"}, f"{cell.id}: offload_param cpu, but params in {kinds}"
        assert zj.memory_report(run.state).by_part["params"].get("device", 0) == 0
    else:
        assert kinds <= {"device", None}, f"{cell.id}: no offload_param, but params in {kinds}"
    if cell.optimizer == "nvme":  # the optimizer state really went to files
        assert os.path.exists(os.path.join(nvme_dir, "zerojax_optimizer_p0", "COMMITTED"))
        assert run.state.opt_state is None
    elif cell.zenflow:  # the step keeps the host state in its own buffers
        assert run.state.opt_state is None
    elif cell.optimizer == "cpu":
        opt_kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(run.state.opt_state)
                     if getattr(x, "ndim", 0)}
        assert opt_kinds == {"pinned_host"}, f"{cell.id}: offload_optimizer cpu, but its state in {opt_kinds}"

    if cell.precision == "fp32" and not (cell.zeropp or cell.zenflow):  # both change the numbers
        ref = reference(cell.gas)
        np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-6)
        for got, want in zip(run.params, ref.params):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=cell.id)


# --------------------------------------------------------------------------- the cells
OFFLOADS = (None, "cpu", "nvme")
GRID = [Cell(stage, opt, param, precision)
        for stage, opt, param, precision in itertools.product((0, 1, 2, 3), OFFLOADS, OFFLOADS, ("fp32", "bf16"))
        if param is None or stage == 3]
EXTRAS = [
    Cell(2, "cpu", gas=2),
    Cell(3, "nvme", "cpu", gas=2),
    Cell(3, None, "cpu", gas=2),
    Cell(2, None, precision="fp16"),
    Cell(3, "cpu", "cpu", precision="fp16"),
    Cell(2, "nvme", precision="fp16"),
    Cell(3, None, None, "bf16", zeropp=True),
    Cell(3, "cpu", "cpu", "bf16", zeropp=True),
    Cell(2, "cpu", zenflow=True),
    Cell(3, "cpu", "cpu", zenflow=True),
]
# the quick tier: ZeRO-Infinity's layout (params in host memory, optimizer state on NVMe), which
# once failed in the embedding lookup, its on-device twin, and two refusals that compile nothing
QUICK = [Cell(3, "nvme", "cpu"), Cell(3, None, "cpu"), Cell(3, "nvme", "nvme"), Cell(0, "cpu")]


def test_the_cells_cover_the_grid():
    assert len(GRID) == 2 * (3 * 3 + 3 * 3)  # x precision: stages 0-2 x optimizer; stage 3: optimizer x param
    assert set(QUICK) <= set(GRID)
    # refused: optimizer offload at stage 0 (4), params on NVMe without the NVMe optimizer (4); the
    # other 28 train
    assert sum(refusal(c) is None for c in GRID) == 28


@pytest.mark.parametrize("cell", QUICK, ids=[c.id for c in QUICK])
def test_representative_cells_train_or_are_refused_by_name(cell, tmp_path):
    check_cell(cell, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in GRID + EXTRAS if c not in QUICK],
                         ids=[c.id for c in GRID + EXTRAS if c not in QUICK])
def test_every_cell_trains_or_is_refused_by_name(cell, tmp_path):
    check_cell(cell, tmp_path)
