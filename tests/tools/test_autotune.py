"""autotune on 8 simulated devices with a small MLP: fits are compiled peaks, the search finds
what an exhaustive table says is best, timed mode ranks by real steps, and no-fit errors."""
import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from zerojax import _compat
from zerojax.tools import _gpu
from zerojax.tools.autotune import OFFLOADS, AutotuneError, parse_bytes
from zerojax.tools._planning import StepPlan

D, H, OUT, T = 64, 512, 16, 64
BASE = zj.ZeroConfig(param_persistence_threshold=0)  # stage 3 partitions even these small leaves
TX = optax.adamw(1e-4)


def init_fn(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w1": jax.random.normal(k1, (D, H)) * 0.1, "w2": jax.random.normal(k2, (H, H)) * 0.05,
            "w3": jax.random.normal(k3, (H, OUT)) * 0.05}


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    h = jnp.tanh(h @ params["w2"])
    return ((h @ params["w3"]) ** 2).mean()


def batch_fn(micro_batch):
    return {"x": jax.ShapeDtypeStruct((micro_batch, T, D), jnp.float32)}


KW = dict(devices=8, config=BASE, tx=TX, stages=(0, 3), micro_batches=(1, 8))


PSI = D * H + H * H + H * OUT  # every dim divides 8: nothing is padded


def host_bytes_formula(row) -> int:
    """Offloaded state per device from the ZeRO formula (fp32 AdamW: the params are the master):
    the two moments 8 PSI / N and Adam's step count with the optimizer offloaded, the params'
    4 PSI / N too when they are offloaded as well (stage 3)."""
    host = {"none": 0, "optimizer": 8 * PSI // 8 + 4, "optimizer+param": 8 * PSI // 8 + 4 + 4 * PSI // 8}
    return host[row.offload]


def device_peak_reference(row):
    """The compiled peak of the real step on real shards, less the offloaded state (which the CPU
    compiler counts in the same address space), from the formula."""
    state = zj.shard_train_state(init_fn, TX, mesh=zj.make_mesh(8), config=row.config, rng=jax.random.PRNGKey(0))
    step = zj.make_train_step(loss_fn, state)
    batch = {"x": jax.ShapeDtypeStruct((8 * row.gradient_accumulation_steps * row.micro_batch, T, D), jnp.float32)}
    host = host_bytes_formula(row)
    return zj.peak_memory(step, state, batch).peak - host, host


def check_row_peak(row):
    peak, host = device_peak_reference(row)
    assert (row.peak_bytes, row.host_bytes) == (peak, host), row
    assert (row.offload == "none") == (host == 0)


def expected_best(table, budget):
    """The cost model's choice among candidates that fit ``budget``, from a fully compiled table."""
    fitting = [r for r in table if r.peak_bytes <= budget]
    order = list(OFFLOADS)
    best = max(fitting, key=lambda r: (r.samples_per_second, -r.stage, -order.index(r.offload)))
    return best.stage, best.offload, best.micro_batch


@pytest.fixture(scope="module")
def full():
    return zj.autotune(init_fn, loss_fn, batch_fn, budget="1GiB", exhaustive=True, **KW)


def test_table_covers_every_candidate_and_fits_follow_compiled_peaks(full):
    got = {(r.stage, r.offload, r.micro_batch) for r in full.table}
    want = {(s, o, mb) for s, o in ((0, "none"), (3, "none"), (3, "optimizer"), (3, "optimizer+param"))
            for mb in (1, 8)}
    assert got == want and len(full.table) == len(want)
    assert full.compilations == len(want) and all(r.fits for r in full.table)
    # the peaks are the real step's, on real shards, offloaded state excluded
    for key in ((0, "none", 8), (3, "optimizer", 8), (3, "optimizer+param", 1)):
        check_row_peak(next(r for r in full.table if (r.stage, r.offload, r.micro_batch) == key))
    # the peak grows with the micro-batch, and ZeRO-3 needs less than ZeRO-0
    peaks = {(r.stage, r.offload, r.micro_batch): r.peak_bytes for r in full.table}
    assert peaks[0, "none", 8] > peaks[0, "none", 1] > peaks[3, "none", 1]
    text = str(full)
    assert "stage" in text and "optimizer+param" in text and text.count("\n") == len(want) + 2


def test_peak_check_catches_a_peak_that_keeps_the_offloaded_state(monkeypatch):
    monkeypatch.setattr(StepPlan, "device_peak_bytes", property(lambda self: self.peak_bytes))
    result = zj.autotune(init_fn, loss_fn, batch_fn, budget="1GiB", exhaustive=True, devices=8, config=BASE, tx=TX,
                         stages=(3,), offloads=("optimizer",), micro_batches=(1,))
    with pytest.raises(AssertionError):
        check_row_peak(result.table[0])


def test_recommendation_fits_and_moves_when_the_budget_drops_below_it(full):
    previous = None
    budget = parse_bytes("1GiB")
    for _ in range(3):  # stage 0, then stage 3, then stage 3 with the optimizer offloaded
        result = zj.autotune(init_fn, loss_fn, batch_fn, budget=budget, **KW)
        best = result.best
        assert best.fits and best.peak_bytes <= budget
        assert best.peak_bytes == device_peak_reference(best)[0]
        # the pruned search finds what the fully compiled table says is best, with fewer compilations
        assert (best.stage, best.offload, best.micro_batch) == expected_best(full.table, budget)
        assert result.compilations < len(full.table)
        # every settled row agrees with the compiled peaks: compiled rows directly, the rest by the
        # micro-batch bisection (fits below a fitting one, not above a failing one)
        peaks = {(r.stage, r.offload, r.micro_batch): r.peak_bytes for r in full.table}
        for r in result.table:
            key = (r.stage, r.offload, r.micro_batch)
            if r.compiled:
                assert r.peak_bytes == peaks[key]
            if r.fits is not None:
                assert r.fits == (peaks[key] <= budget), r
        if previous is not None:
            assert (best.stage, best.offload, best.micro_batch) != previous
        previous = (best.stage, best.offload, best.micro_batch)
        budget = best.peak_bytes - 1
    # the recommendation as DeepSpeed JSON reads back into the same config
    ds = result.deepspeed_config()
    back = zj.ZeroConfig.from_deepspeed(ds, world_size=8)
    assert (back.stage, back.offload_optimizer, back.offload_param) == (best.config.stage,
                                                                         best.config.offload_optimizer,
                                                                         best.config.offload_param)
    assert back.train_micro_batch_size_per_gpu == best.micro_batch


def test_timed_mode_measures_real_steps_and_picks_the_fastest():
    # a fixed global batch of 64: micro-batch 2 runs 4 accumulation steps, micro-batch 8 one
    result = zj.autotune(init_fn, loss_fn, batch_fn, devices=8, config=BASE, tx=TX, stages=(2,),
                         offloads=("none",), micro_batches=(2, 8), train_batch_size=64, budget="1GiB",
                         timed=True, warmup=1, steps=3)
    rows = result.table
    assert [r.gradient_accumulation_steps for r in rows] == [4, 1]
    assert all(r.measured_seconds is not None and 0 < r.measured_seconds < 30 for r in rows)
    assert result.best is min(rows, key=lambda r: r.measured_seconds)
    assert result.ranked_by == "measured time" and "measured" in str(result)


def test_too_small_budget_names_the_smallest_peak():
    with pytest.raises(AutotuneError, match=r"no candidate fits.*smallest peak compiled was .*stage 3.*"
                                            r"optimizer\+param") as e:
        zj.autotune(init_fn, loss_fn, batch_fn, devices=8, config=BASE, tx=TX, stages=(3,),
                    offloads=("optimizer+param",), micro_batches=(1,), budget=1000)
    assert "more devices" in str(e.value) and "devices=16" in str(e.value)
    assert e.value.result.best is None and e.value.result.table[0].fits is False


def test_arguments_are_checked():
    with pytest.raises(zj.ConfigError, match="not an amount of memory"):
        parse_bytes("80 parsecs")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000
    with pytest.raises(zj.ConfigError, match="timed=True runs real steps on 16 devices"):
        zj.autotune(init_fn, loss_fn, batch_fn, devices=16, budget="1GiB", timed=True)
    with pytest.raises(zj.ConfigError, match="timed=True runs real steps, and target='h100'"):
        zj.autotune(init_fn, loss_fn, batch_fn, devices=8, budget="1GiB", timed=True, target="h100")
    with pytest.raises(zj.ConfigError, match="h100"):
        zj.autotune(init_fn, loss_fn, batch_fn, devices=8, budget="1GiB", target="tpu9")
    with pytest.raises(zj.ConfigError, match="memory .* is unknown"):
        zj.autotune(init_fn, loss_fn, batch_fn, devices=8)
    with pytest.raises(zj.ConfigError, match="offloads"):
        zj.autotune(init_fn, loss_fn, batch_fn, devices=8, budget="1GiB", offloads=("disk",))


@pytest.mark.skipif(_compat.cuda_plugin() is None,
                    reason=f"JAX's CUDA plugin is not installed: {_gpu.install_command()}")
def test_a_target_compiles_every_candidate_with_xla_gpu_and_budgets_its_memory():
    result = zj.autotune(init_fn, loss_fn, batch_fn, target="h100", **KW)
    assert result.budget == _gpu.gpu_target("h100").memory_bytes
    compiled = [r for r in result.table if r.compiled]
    assert compiled and all(r.plan.target == "h100" and r.peak_bytes == r.plan.device_peak_bytes for r in compiled)
    assert result.best.fits
