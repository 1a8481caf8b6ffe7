"""Unpacking a bucket (zerojax.stages._collectives.pieces): the right parts, and a stage-1 step
whose leaves share kernels where slices at constant offsets gave each leaf its own."""
import re

import jax
import jax.numpy as jnp
import functools

import numpy as np
import optax

import zerojax as zj
import zerojax.stages._collectives as C
from zerojax.models.gpt import GPTConfig, init_params, loss_fn

from zerojax.stages._collectives import pieces

SIZES = [16, 16, 16, 16, 8]


def kernel_bodies(fn, *args) -> set:
    """The distinct fused computations of ``fn``'s optimized program (a jitted function), names
    and metadata stripped: what XLA compiles as separate kernels."""
    text = fn.lower(*args).compile().as_text()
    bodies = set()
    for block in re.findall(r"\n(%fused\S* \([^\n]*\{\n.*?\n\})", text, re.S):
        lines = block.splitlines()[1:-1]
        body = [re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line)).strip() for line in lines]
        bodies.add("\n".join(sorted(body)))
    return bodies


def test_pieces_are_the_consecutive_parts():
    flat = jnp.arange(sum(SIZES), dtype=jnp.float32)
    got = jax.jit(lambda f: pieces(f, SIZES))(flat)
    want = np.split(np.asarray(flat), np.cumsum(SIZES)[:-1])
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    rows = jnp.arange(3 * sum(SIZES), dtype=jnp.float32).reshape(3, -1)
    for g, w in zip(pieces(rows, SIZES, axis=1), np.split(np.asarray(rows), np.cumsum(SIZES)[:-1], axis=1)):
        np.testing.assert_array_equal(np.asarray(g), w)


def constant_slices(flat, sizes, axis=0):
    """The unpacking before pieces(): a slice at each constant offset."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return [jax.lax.slice_in_dim(flat, int(s), int(s) + n, axis=axis) for s, n in zip(starts, sizes)]


def stage1_kernels():
    cfg = GPTConfig(vocab=96, n_layer=3, d_model=32, n_head=2, seq_len=8)
    init = functools.partial(init_params, cfg, jax.random.PRNGKey(0))
    state = zj.shard_train_state(lambda _: init(), optax.adamw(1e-3), mesh=zj.make_mesh(),
                                 config=zj.ZeroConfig(stage=1))
    step = zj.make_train_step(loss_fn(cfg), state)
    batch = {"tokens": np.zeros((16, cfg.seq_len + 1), np.int32)}
    return kernel_bodies(step.jitted, state, batch)


def test_the_stage1_step_compiles_fewer_kernels_than_with_constant_offsets(monkeypatch):
    """A 3-layer GPT's leaves come in a few shapes; with the bucket's offsets as values their
    updates share kernels, with constant offsets each leaf has its own."""
    shared = stage1_kernels()
    monkeypatch.setattr(C, "pieces", constant_slices)
    own = stage1_kernels()
    assert len(shared) < 0.85 * len(own), (len(shared), len(own))


def test_no_kernel_computes_the_offsets_on_the_cpu():
    """On the CPU backend the offsets are a conditional's outputs (buffers the slices read), not
    one-scalar kernels, one per piece, as behind a barrier alone."""
    sizes = [16, 16, 8, 24, 16]
    text = jax.jit(lambda flat, other: [(p * 2.0, p + other[:p.size]) for p in pieces(flat, sizes)]).lower(
        jnp.ones(80), jnp.ones(80)).compile().as_text()
    assert re.findall(r"= s32\[\] fusion\(\)", text) == []
    assert len(re.findall(r" conditional\(", text)) == 1


def test_the_platform_lowered_for_decides_conditional_or_barrier():
    """The offsets and a bucket's own buffers (C.own_buffers) are a conditional's outputs in a
    program lowered for the CPU, an optimization barrier's in one lowered for a GPU, whatever
    this process's backend is: a step compiled here for compile-only GPUs (plan_step's target)
    is the program a GPU would run."""
    sizes = [16, 16, 8, 24, 16]
    traced = jax.jit(lambda flat: C.own_buffers(lambda f: pieces(f, sizes), flat)).trace(jnp.ones(80))
    cpu, gpu = traced.lower().as_text(), traced.lower(lowering_platforms=("cuda",)).as_text()
    hidden_predicate = r"optimization_barrier %\w+ : tensor<i1>"  # a conditional's, on the CPU
    barriered_pieces = r"optimization_barrier( %\w+,){4} %\w+ : (tensor<\d+xf32>, ){4}tensor<16xf32>"
    assert re.search(hidden_predicate, cpu) and not re.search(barriered_pieces, cpu)
    assert re.search(barriered_pieces, gpu) and not re.search(hidden_predicate, gpu)


def _lowered_gpt_step(stage, scan=False):
    cfg = GPTConfig(vocab=96, n_layer=3, d_model=32, n_head=2, seq_len=8, scan=scan)
    init = functools.partial(init_params, cfg, jax.random.PRNGKey(0))
    state = zj.shard_train_state(lambda _: init(), optax.adamw(1e-3), mesh=zj.make_mesh(),
                                 config=zj.ZeroConfig(stage=stage))
    step = zj.make_train_step(loss_fn(cfg), state)
    batch = {"tokens": np.zeros((16, cfg.seq_len + 1), np.int32)}
    return state.plan, step.jitted.lower(state, batch).as_text()


def test_the_stage1_step_lowers_no_per_leaf_device_ids_and_no_needless_transposes():
    """Every leaf's local slice reads one axis_index of its region (not a device-id computation
    each), and a leaf split along its first dim enters and leaves a bucket by reshapes alone:
    stage 1 holds no transpose stage 0 lacks but, for the leaves split along a later dim, one
    per leaf where the all-gather's buffer is unpacked and one per run length (``before``) where
    the reduce-scatter's is packed (the model fits one bucket of each). The model is a
    ``lax.scan`` GPT of 3 layers: its stacked leaves are split along a later dim on 8 devices."""
    plan, s1 = _lowered_gpt_step(1, scan=True)
    _, s0 = _lowered_gpt_step(0, scan=True)
    regions = s1.count("sdy.manual_computation")
    assert 0 < s1.count("stablehlo.partition_id") <= regions
    runs = [C._split_view(lay, plan.n)[0] for lay in plan.leaves if lay.params_partitioned or plan.opt_partitioned(lay)]
    later = [r for r in runs if r > 1]
    assert len(later) > len(set(later)) > 0  # several leaves share a run length: one transpose packs them
    assert s1.count("stablehlo.transpose") - s0.count("stablehlo.transpose") == len(later) + len(set(later))
