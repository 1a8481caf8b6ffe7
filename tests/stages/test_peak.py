"""Stage 3's compiled peak with every param partitioned (``param_persistence_threshold: 0``), the
biases and norms too, and DeepSpeed's "auto" prefetch bucket: at ``max_reuse_distance: 0`` a few
layers' params are gathered at a time, in a Python loop and under ``lax.scan`` alike."""
import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.models.gpt import GPTConfig, init_params, loss_fn


def _peak(cfg, **config):
    mesh = zj.make_mesh()
    config = zj.ZeroConfig(prefetch_bucket_size=int(0.9 * cfg.d_model**2), param_persistence_threshold=0, **config)
    state = zj.abstract_train_state(lambda k: init_params(cfg, k), optax.adamw(1e-3), mesh=mesh, config=config)
    step = zj.make_train_step(loss_fn(cfg), state)
    return zj.peak_memory(step, state, {"tokens": jax.ShapeDtypeStruct((8, 17), np.int32)})


@pytest.mark.parametrize("scan,bound", [(False, 0.25), (True, 0.285)])
def test_stage3_lean_peak_holds_a_few_layers_not_the_model(scan, bound):
    # 8 layers, d 64: a layer has 12 use sites of partitioned params and about 4 buckets of them.
    # Before, every use site added a bucket of params not gathered yet (those already on the way
    # did not count), so the gathers ran layers ahead of the compute; each bucket's params were
    # slices of one buffer, and GELU's input, recomputed in the backward pass from the bias,
    # held its whole bucket until then; under scan every layer's shards were saved again for the
    # backward pass. Compiled peaks over stage 0's, before -> after (under the test suite's XLA
    # flags): Python loop 0.38x -> 0.19x, scan 0.29x -> 0.27x
    cfg = GPTConfig(vocab=512, n_layer=8, d_model=64, n_head=4, seq_len=16, scan=scan)
    base = _peak(cfg, stage=0)
    lean = _peak(cfg, stage=3, max_reuse_distance=0)
    assert lean.peak <= bound * base.peak, (lean, base, lean.peak / base.peak)
