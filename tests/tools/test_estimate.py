"""Estimates: DeepSpeed's estimators (golden values), the ZeRO paper model, and zj.estimate
against memory_report of real states and the ZeRO formula (padding written out)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
import zerojax._plan
from tests.helpers import init_params
from zerojax._cli import main
from zerojax.tools._estimate import (estimate, estimate_zero2_model_states_mem_needs,
                              estimate_zero2_model_states_mem_needs_all_cold,
                              estimate_zero2_model_states_mem_needs_all_live,
                              estimate_zero3_model_states_mem_needs,
                              estimate_zero3_model_states_mem_needs_all_cold,
                              estimate_zero3_model_states_mem_needs_all_live, zero_paper_bytes)
from zerojax.models.gpt import GPT2_SMALL
from zerojax.models.gpt import init_params as gpt_init

P_TOTAL, L_LARGEST = 2851e6, 32e6


def gib(n):
    return round(n / 2**30, 2)


# ------------------------------------------------------------------- DeepSpeed's golden values
@pytest.mark.parametrize("cpu_offload,cpu,gpu", [(True, 127.45, 5.31), (False, 127.45, 11.28)])
def test_zero2_golden(cpu_offload, cpu, gpu):
    c, g = estimate_zero2_model_states_mem_needs(P_TOTAL, num_gpus_per_node=8, num_nodes=1, cpu_offload=cpu_offload)
    assert (gib(c), gib(g)) == (cpu, gpu)


@pytest.mark.parametrize("cpu_offload,cpu_offload_params,cpu,gpu", [
    (True, True, 71.69, 0.12),    # params and optimizer offloaded
    (True, False, 63.72, 0.78),   # optimizer offloaded only
    (False, False, 1.43, 6.09),   # no offload
])
def test_zero3_golden(cpu_offload, cpu_offload_params, cpu, gpu):
    c, g, largest = estimate_zero3_model_states_mem_needs(
        P_TOTAL, L_LARGEST, num_gpus_per_node=8, num_nodes=1, cpu_offload=cpu_offload,
        cpu_offload_params=cpu_offload_params, zero_init=True)
    assert (gib(c), gib(g)) == (cpu, gpu)
    assert largest == 4 * L_LARGEST


def test_zero3_without_zero_init_loads_the_full_model_per_process():
    # each local process builds the whole fp32 model on the host first
    c, _, _ = estimate_zero3_model_states_mem_needs(P_TOTAL, L_LARGEST, 8, 1, cpu_offload=False,
                                                    cpu_offload_params=False, zero_init=False)
    assert c == int(P_TOTAL * 4 * 8 * 1.5)
    c, _, _ = estimate_zero3_model_states_mem_needs(P_TOTAL, L_LARGEST, 8, 1, zero_init=False)
    assert c == int(P_TOTAL * max(4 * 8, 18) * 1.5)


def test_multi_node_partitions_host_state_over_nodes():
    one, _, _ = estimate_zero3_model_states_mem_needs(P_TOTAL, L_LARGEST, 8, 1)
    four, g4, _ = estimate_zero3_model_states_mem_needs(P_TOTAL, L_LARGEST, 8, 4, cpu_offload_params=False)
    assert one == int(P_TOTAL * 18 * 1.5)
    assert four == int(P_TOTAL * 16 / 4 * 1.5)
    assert g4 == 4 * L_LARGEST + int(2 * P_TOTAL / 32)


def test_all_cold_tables_hold_every_option(capsys):
    z2 = estimate_zero2_model_states_mem_needs_all_cold(P_TOTAL, num_gpus_per_node=8)
    z3 = estimate_zero3_model_states_mem_needs_all_cold(P_TOTAL, L_LARGEST, num_gpus_per_node=8)
    out = capsys.readouterr().out
    assert [(gib(r.cpu_bytes), gib(r.gpu_bytes)) for r in z2.rows] == [(127.45, 5.31), (127.45, 11.28)]
    assert len(z3.rows) == 6  # (param+opt, opt only, none) x zero_init
    got = {(dict(r.options)["offload_param"], dict(r.options)["offload_optimizer"], dict(r.options)["zero_init"]):
           (gib(r.cpu_bytes), gib(r.gpu_bytes)) for r in z3.rows}
    assert got[("cpu", "cpu", True)] == (71.69, 0.12)
    assert got[("none", "cpu", True)] == (63.72, 0.78)
    assert got[("none", "none", True)] == (1.43, 6.09)
    assert "127.45GiB |    5.31GiB | offload_optimizer=cpu" in out
    assert "71.69GiB |    0.12GiB | offload_param=cpu, offload_optimizer=cpu, zero_init=1" in out
    assert "2851M total params, 32M largest layer params" in out and "1 node, 8 GPUs per node" in out


def test_all_live_counts_the_tree_and_its_largest_leaf(capsys):
    params = {"a": jax.ShapeDtypeStruct((1000, 300), jnp.float32), "b": [jnp.zeros((7,)), jnp.zeros((50, 50))]}
    total, largest = 300_000 + 7 + 2500, 300_000
    live3 = estimate_zero3_model_states_mem_needs_all_live(params, num_gpus_per_node=4, print_table=False)
    cold3 = estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=4, print_table=False)
    assert live3 == cold3
    live2 = estimate_zero2_model_states_mem_needs_all_live(params, num_gpus_per_node=4)
    assert live2 == estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=4, print_table=False)
    assert "offload_optimizer=none" in capsys.readouterr().out


@pytest.mark.parametrize("call,match", [
    (lambda: estimate_zero2_model_states_mem_needs(0), "total_params"),
    (lambda: estimate_zero2_model_states_mem_needs(1e9, num_gpus_per_node=0), "num_gpus_per_node"),
    (lambda: estimate_zero3_model_states_mem_needs(1e9, 2e9), "largest_layer_params"),
    (lambda: estimate_zero3_model_states_mem_needs(1e9, 1e6, cpu_offload=False), "cpu_offload_params"),
    (lambda: estimate_zero3_model_states_mem_needs_all_live({}), "params"),
    (lambda: estimate({"w": jnp.zeros((4,))}, "eight"), "mesh_or_device_count"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(zj.ConfigError, match=match):
        call()


# --------------------------------------------------------------------- the ZeRO paper's model
def test_paper_worked_example():
    got = [round(zero_paper_bytes(7.5e9, 64, stage) / 1e9, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


# ------------------------------------------------------------- zj.estimate == memory_report
CASES = [(stage, precision, {}) for stage in range(4) for precision in ("fp32", "bf16")] + [
    (3, "fp32", {"param_persistence_threshold": 0}),
    (3, "bf16", {"param_persistence_threshold": 0}),
    (2, "bf16", {"offload_optimizer": "cpu"}),
]


@pytest.mark.parametrize("stage,precision,extra", CASES)
def test_estimate_equals_memory_report_of_the_real_state(stage, precision, extra):
    params = init_params(jax.random.PRNGKey(0))
    config = zj.ZeroConfig(stage=stage, precision=precision, **extra)
    mesh = zj.make_mesh()
    real = zj.memory_report(zj.shard_train_state(params, optax.adamw(1e-3), mesh=mesh, config=config))
    shapes = jax.eval_shape(init_params, jax.random.PRNGKey(0))
    for est in (estimate(params, mesh, config), estimate(shapes, 8, config)):
        assert est.by_part == real.by_part
        assert est.per_device == real.per_device
        assert est.max_bytes("device") == real.max_bytes("device")


def test_estimate_with_model_parallel_axis_and_other_optimizer():
    params = init_params(jax.random.PRNGKey(0))
    specs = jax.tree_util.tree_map(lambda _: P(), params)
    specs["dense"]["kernel"] = P(None, "model")
    mesh = zj.make_mesh((4, 2), ("data", "model"))
    config = zj.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0)
    tx = optax.adafactor(1e-3)
    real = zj.memory_report(zj.shard_train_state(params, tx, mesh=mesh, config=config, param_specs=specs))
    est = estimate(params, mesh, config, tx, param_specs=specs)
    assert est.per_device == real.per_device and est.by_part == real.by_part
    assert estimate(params, {"data": 4, "model": 2}, config, tx, param_specs=specs).by_part == real.by_part


@pytest.fixture(scope="module")
def gpt2_shapes():
    return jax.eval_shape(lambda k: gpt_init(GPT2_SMALL, k), jax.random.PRNGKey(0))


D, VOCAB, SEQ, LAYERS = 768, 50257, 1024, 12


def gpt2_small_stored(n: int) -> int:
    """GPT-2 small's elements as stored split over n devices, written out leaf by leaf: each leaf
    is split along the dim that needs the least relative padding to a multiple of n."""
    if n in (8, 64):  # every leaf has a dim of 768, 2304 or 3072 elements: each divides 8 and 64
        return GPT2_SMALL.n_params
    assert n == 512
    vec = 1024  # (768,) -> 1024
    block = (6 * vec                # ln1, ln2 scale and bias, attn and mlp proj bias
             + D * 2560 + 2560      # qkv (768, 2304): 2304 -> 2560 (x1.11) beats 768 -> 1024 (x1.33)
             + 1024 * D             # attn proj (768, 768): 768 -> 1024
             + D * 3072 + 3072      # mlp fc (768, 3072): 3072 divides 512
             + 3072 * D)            # mlp proj (3072, 768)
    return (50688 * D               # wte (50257, 768): 50257 -> 50688 (x1.009) beats 768 -> 1024
            + SEQ * D               # wpe (1024, 768): 1024 divides 512
            + LAYERS * block + 2 * vec)  # ln_f


def zero_formula(psi: int, stored: int, n: int, stage: int, precision: str) -> dict:
    """Stored bytes per device by part (REFERENCE.md section 1 without the transient gradients):
    16-bit params (bf16) or fp32 params that are the master (fp32); fp32 master and AdamW's two
    moments; what a stage partitions is stored/n, the rest psi whole; plus Adam's step count."""
    p_bytes = 2 if precision == "bf16" else 4
    params = p_bytes * (stored // n if stage == 3 else psi)
    state = stored // n if stage >= 1 else psi
    out = {"params": params, "optimizer": 8 * state + 4}
    if precision == "bf16":
        out["master"] = 4 * state
    return out


def check_estimate_formula(gpt2_shapes, stage, devices, precision):
    config = zj.ZeroConfig(stage=stage, precision=precision, param_persistence_threshold=0)
    report = estimate(gpt2_shapes, devices, config)
    want = zero_formula(GPT2_SMALL.n_params, gpt2_small_stored(devices), devices, stage, precision)
    got = {part: kinds["device"] for part, kinds in report.by_part.items() if part != "other"}
    assert got == want, (stage, devices, precision)
    assert report.max_bytes("device") == sum(want.values()) + report.by_part["other"]["device"]
    assert len(report.per_device) == devices


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage,devices", [(0, 512), (1, 512), (2, 512), (3, 8), (3, 64), (3, 512)])
def test_estimate_any_device_count_matches_zero_formula(gpt2_shapes, stage, devices, precision):
    assert devices > jax.device_count() or devices == 8
    check_estimate_formula(gpt2_shapes, stage, devices, precision)


def test_formula_check_catches_a_plan_that_pads_more(gpt2_shapes, monkeypatch):
    def last_free_dim(shape, base_spec, n, *rest):  # always split the last dim (wte: 768 -> 1024)
        dims = [d for d, size in enumerate(shape) if base_spec[d] is None and size]
        return (None, 0) if not dims else (dims[-1], -(-shape[dims[-1]] // n) * n)

    monkeypatch.setattr(zerojax._plan, "_choose_axis", last_free_dim)
    with pytest.raises(AssertionError):
        check_estimate_formula(gpt2_shapes, 3, 512, "bf16")


# ---------------------------------------------------------------------------------- the CLI
def test_cli_prints_every_stage_and_offload_choice(capsys):
    assert main(["estimate", "memory", "--params", "2851e6", "--largest-layer", "32M", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    for line in ("127.45GiB |    5.31GiB | offload_optimizer=cpu", "127.45GiB |   11.28GiB | offload_optimizer=none",
                 "71.69GiB |    0.12GiB | offload_param=cpu, offload_optimizer=cpu, zero_init=1",
                 "63.72GiB |    0.78GiB | offload_param=none, offload_optimizer=cpu, zero_init=1",
                 "1.43GiB |    6.09GiB | offload_param=none, offload_optimizer=none, zero_init=1"):
        assert line in out
    for stage in range(4):
        assert f"stage {stage}" in out


def test_cli_states_the_assumed_largest_layer(capsys):
    assert main(["estimate", "memory", "--params", "7B", "--devices", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "largest layer 140,000,000 params (assumed 2% of the params" in out
    assert "--largest-layer" in out and "2 nodes, 8 GPUs per node" in out


def test_cli_rejects_bad_numbers(capsys):
    assert main(["estimate", "memory", "--params", "7e9", "--largest-layer", "8e9"]) == 2
    assert "--largest-layer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", "memory", "--params", "seven"])
    assert "7e9, 7B or 125M" in capsys.readouterr().err
