"""Every engine's step lowered for CUDA on the simulated 8-device CPU mesh: what a GPU needs.

A CPU-only suite never compiles for a GPU, so a step that traces here but cannot run there
(a CPU-only custom call, a host callback, a kernel left in interpret mode, a collective that only
the CPU program has) would pass every other test. JAX lowers for another platform without its
devices: ``step.trace(state, batch).lower(lowering_platforms=("cuda",))``. :func:`check_cuda`
lowers each step for CUDA and for this machine and checks that

* it lowers for CUDA at all;
* no custom call is one a GPU lacks (only XLA's placement/sharding markers and the GPU kernels),
  and no host callback is left in the program;
* host memory (``pinned_host``) appears where state is offloaded and nowhere else;
* the collectives of the CPU lowering are all in the CUDA one (op counts of all-gather,
  reduce-scatter, all-reduce, all-to-all and collective-permute, equal);
* a ``fused_adam=True`` step holds the GPU kernel's custom call (``xla.gpu.triton`` on JAX
  0.10), and no other step does.

Where JAX's CUDA plugin is installed (CI's oldest environment installs it), each CUDA lowering is
also compiled by XLA's GPU compiler for 8 compile-only H100s (:func:`gpu_program_problems`, the
way ``zj.plan_step(target="h100")`` compiles), and the compiled program is checked too: it
compiles, its custom calls are all GPU kernels (cuBLAS/cuDNN/Triton) or the host computation of
an offloaded update, host-resident state is in its host arguments and not in its device bytes,
the fused Adam is a compiled Triton (or Mosaic GPU) kernel, and every collective is asynchronous
(a start/done pair XLA:GPU can overlap).

The controls at the end show each check failing on a program built to break it.
"""
import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn
from zerojax._compat import cuda_plugin, pallas_gpu_backend, shard_map
from zerojax.tools._compiled import overlap, program_custom_calls
from zerojax.tools._gpu import compile_for_devices

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")
_COLLECTIVE = re.compile(r"stablehlo\.(" + "|".join(COLLECTIVES) + r")\b")
_TARGET = re.compile(r'custom_call @([\w.$-]+)|call_target_name = "([^"]+)"')
# the GPU kernel a fused step must hold, by the Pallas backend zerojax uses for CUDA
GPU_KERNEL = {"triton": "xla.gpu.triton", "mosaic_gpu": "mosaic_gpu"}
# custom calls a GPU program may hold: XLA's memory-placement and sharding markers, the kernels
GPU_TARGETS = {"annotate_device_placement", "MoveToHost", "MoveToDevice", "Sharding", "SPMDFullToShardShape",
               "SPMDShardToFullShape", "xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2"}


def collectives(text: str) -> collections.Counter:
    return collections.Counter(_COLLECTIVE.findall(text))


def custom_calls(text: str) -> collections.Counter:
    """Custom-call targets, without a platform tag (``__gpu$xla.gpu.triton``: ``xla.gpu.triton``)."""
    return collections.Counter((a or b).rpartition("$")[2] for a, b in _TARGET.findall(text))


def cuda_problems(traced, *, host_memory: bool = False, gpu_kernel: bool = False) -> list:
    """What keeps ``traced`` (a jax ``Traced``) from running on a GPU; empty when nothing does."""
    return _cuda_problems(traced, host_memory=host_memory, gpu_kernel=gpu_kernel)[0]


def _cuda_problems(traced, *, host_memory: bool = False, gpu_kernel: bool = False):
    """(:func:`cuda_problems`, the CUDA program's text or None where it does not lower)."""
    try:
        lowered = traced.lower(lowering_platforms=("cuda",))
        cuda = lowered.as_text()
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        return [f"does not lower for CUDA: {type(e).__name__}: {str(e)[:400]}"], None
    cpu = traced.lower().as_text()
    problems = []
    targets = custom_calls(cuda)
    foreign = sorted(t for t in targets if t not in GPU_TARGETS and not t.startswith("mosaic_gpu"))
    if foreign:
        problems.append(f"custom calls a GPU lacks or must not run in a step: {foreign}")
    if ("pinned_host" in cuda) != host_memory:
        problems.append("host memory (pinned_host) " + ("missing" if host_memory else "where nothing is offloaded"))
    if collectives(cpu) != collectives(cuda):
        problems.append(f"collectives differ: CPU {dict(collectives(cpu))}, CUDA {dict(collectives(cuda))}")
    kernel = GPU_KERNEL[pallas_gpu_backend()]
    kernels = sum(n for t, n in targets.items() if t.startswith(kernel))
    if gpu_kernel and not kernels:
        problems.append(f"no GPU kernel ({kernel}) in the CUDA program")
    if kernels and not gpu_kernel:
        problems.append(f"{kernels} unexpected GPU kernel call(s) ({kernel})")
    # compiled only where the lowering is clean: XLA:GPU aborts the process on a custom call it
    # has no implementation of (the native host kernel's), which the lowering check names instead
    return problems + (compiled_problems(lowered, host_memory=host_memory, gpu_kernel=gpu_kernel)
                       if not problems else []), cuda


# custom calls a compiled GPU program may hold: XLA:GPU's library calls and kernels, and the host
# computation an offloaded update runs as
GPU_PROGRAM_CALLS = re.compile(r"^(__cublas\$|__cudnn\$|__gpu\$xla\.gpu\.triton|mosaic_gpu|HostExecute$)")


def h100s():
    from zerojax.tools._gpu import target_devices
    return target_devices("h100", 8)


def gpu_program_problems(compiled, *, host_memory: bool = False, gpu_kernel: bool = False) -> list:
    """What XLA:GPU's program (``compile_for_devices``'s, or a ``jax.stages.Compiled``) lacks."""
    problems = []
    text = compiled.as_text()
    host_bytes = getattr(compiled.memory_analysis(), "host_argument_size_in_bytes", 0)
    if (host_bytes > 0) != host_memory:
        problems.append(f"GPU program: {host_bytes} bytes of host arguments, but host memory "
                        + ("is what the plan asks" if host_memory else "where nothing is offloaded"))
    calls = program_custom_calls(text)
    foreign = sorted(c for c in calls if not GPU_PROGRAM_CALLS.match(c))
    if foreign:
        problems.append(f"GPU program: custom calls no GPU runs: {foreign}")
    kernels = sum(n for c, n in calls.items() if c.startswith(("__gpu$xla.gpu.triton", "mosaic_gpu")))
    if gpu_kernel != (kernels > 0):
        problems.append(f"GPU program: {kernels} compiled GPU kernel call(s) where {'one' if gpu_kernel else 'none'} "
                        "was expected")
    sync = overlap(text).synchronous
    if sync and not xla_makes_idle_collectives_synchronous():
        problems.append(f"GPU program: synchronous collectives {sync}")
    return problems


@functools.lru_cache(maxsize=None)
def xla_makes_idle_collectives_synchronous() -> bool:
    """Whether this XLA:GPU turns an async collective with nothing to overlap into a synchronous
    one (newer XLA does: jax 0.12's), which makes a tiny test model's collectives synchronous
    for want of compute, not for a fault of the step: one psum alone shows it. False where no
    GPU compiler is installed (no program of it to read)."""
    if cuda_plugin() is None:
        return False
    mesh = zj.make_mesh()
    psum = jax.jit(shard_map(lambda v: jax.lax.psum(v, "data"), mesh, in_specs=P("data"), out_specs=P()))
    lowered = psum.trace(jnp.zeros(8, jnp.float32)).lower(lowering_platforms=("cuda",))
    return bool(overlap(compile_for_devices(lowered, h100s()).as_text()).synchronous)


def compiled_problems(lowered, **expect) -> list:
    """Compile a CUDA lowering for 8 H100s and check the program; nothing where JAX's CUDA plugin is
    not installed."""
    if cuda_plugin() is None:
        return []
    try:
        compiled = compile_for_devices(lowered, h100s())
    except Exception as e:  # noqa: BLE001 - any refusal is the finding
        return [f"XLA:GPU does not compile it for 8 H100s: {type(e).__name__}: {str(e)[:400]}"]
    return gpu_program_problems(compiled, **expect)


def check_cuda(traced, **expect) -> str:
    """Assert ``traced`` lowers and compiles for CUDA cleanly; returns the CUDA program's text (its
    lowering, which the callers inspect further instead of lowering the same trace again)."""
    problems, cuda = _cuda_problems(traced, **expect)
    assert not problems, "; ".join(problems)
    return cuda


@pytest.fixture(scope="module", autouse=True)
def cuda_lowering_available():
    try:
        jax.jit(jnp.sin).trace(jnp.zeros(3)).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"this jaxlib cannot lower for CUDA: {e}")


def skip_without_gpu_kernel_lowering():
    """jax 0.12 lowers a Triton ``pallas_call`` only where it sees a GPU (or an abstract one, which a
    step over this machine's mesh cannot carry): the fused kernel's lowering is checked elsewhere."""
    from zerojax._compat import pallas_call_lowers_for_cuda
    if not pallas_call_lowers_for_cuda(pallas_gpu_backend()):
        pytest.skip(f"this JAX lowers a {pallas_gpu_backend()} pallas_call for CUDA only on a GPU")


def adamw():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.1)


def traced_step(fused_adam=False, tx=None, **config):
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx or adamw(), config=zj.ZeroConfig(**config))
    step = zj.make_train_step(loss_fn, state, fused_adam=fused_adam, fused_block_size=16)
    return step.trace(state, batches(1)[0])


def test_stages_0_to_3_lower_for_cuda_with_their_collectives():
    for stage in range(4):
        check_cuda(traced_step(stage=stage, param_persistence_threshold=0))


def test_bf16_and_fp16_steps_lower_for_cuda():
    check_cuda(traced_step(stage=3, precision="bf16", param_persistence_threshold=0))
    check_cuda(traced_step(stage=2, precision="fp16"))


def test_optimizer_offload_keeps_host_memory_and_no_cpu_only_kernel():
    """On a CPU mesh the host update is the native kernel's custom call; the CUDA program holds
    the portable update under compute_on instead (the control below shows the difference)."""
    check_cuda(traced_step(stage=2, offload_optimizer="cpu"), host_memory=True)
    check_cuda(traced_step(stage=3, offload_optimizer="cpu", offload_param="cpu", param_persistence_threshold=0),
               host_memory=True)
    text = traced_step(stage=1, precision="bf16", offload_optimizer="cpu").lower(
        lowering_platforms=("cuda",)).as_text()
    assert '_xla_compute_type = "host"' in text  # the update runs on the host, in the same program


def test_nvme_optimizer_offload_device_program_lowers_for_cuda(tmp_path):
    """With the optimizer state on NVMe the device program is the gradients' (the update runs on
    the host, from the files): no host memory, no CPU-only call in it."""
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(),
                                 config=zj.ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path)))
    with zj.make_train_step(loss_fn, state) as step:
        check_cuda(step.trace(state, batches(1)[0]))


def test_fused_adam_step_holds_the_gpu_kernel():
    skip_without_gpu_kernel_lowering()
    traced = traced_step(fused_adam=True, stage=2, precision="bf16")
    text = check_cuda(traced, gpu_kernel=True)
    if pallas_gpu_backend() == "triton":
        assert text.count("xla.gpu.triton") >= 1
    # the same trace lowered for CPU runs the kernel in interpret mode: no GPU call there
    assert not any(t.startswith(("xla.gpu", "mosaic")) for t in custom_calls(traced.lower().as_text()))


def test_zeropp_qwz_hpz_qgz_at_stage3_lower_for_cuda():
    traced = traced_step(stage=3, quantized_weights=True, hpz_partition_size=2, quantized_gradients=True,
                         param_persistence_threshold=0)
    assert collectives(check_cuda(traced))["all_to_all"] > 0  # qgZ


def test_muon_on_owners_lowers_for_cuda_at_stage_0_and_offloaded():
    """Muon's owner paths: stage 0's shard_map and all-gather; with offload_optimizer cpu the
    Muon momentum in host memory, fetched for the device update, and the AdamW group under
    compute_on (no native host kernel: that one is Adam's)."""
    tx = optax.inject_hyperparams(optax.contrib.muon)(learning_rate=0.02, weight_decay=0.01)
    traced = traced_step(tx=tx, stage=0)
    assert collectives(check_cuda(traced))["all_gather"] > 0
    traced = traced_step(tx=tx, stage=2, offload_optimizer="cpu")
    assert '_xla_compute_type = "host"' in check_cuda(traced, host_memory=True)


def test_zenflow_device_program_lowers_for_cuda():
    config = zj.ZeroConfig(stage=2, offload_optimizer="cpu", param_persistence_threshold=0,
                           zenflow={"topk_ratio": 0.25, "update_interval": 2})
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), adamw(), config=config)
    step = zj.make_train_step(loss_fn, state)
    check_cuda(step.trace(state, batches(1)[0]))


def test_autotp_step_lowers_for_cuda():
    params = {"q_proj": {"kernel": np.ones((8, 8), np.float32)}, "o_proj": {"kernel": np.ones((8, 8), np.float32)}}

    def loss(p, b):
        return jnp.sum(jnp.tanh(b["x"] @ p["q_proj"]["kernel"]) @ p["o_proj"]["kernel"])

    state = zj.shard_train_state(params, optax.adamw(1e-3), mesh=zj.autotp_mesh(2),
                                 config=zj.ZeroConfig(stage=2, autotp_size=2))
    check_cuda(zj.make_train_step(loss, state).trace(state, {"x": np.ones((8, 8), np.float32)}))


def gpt_tokens(cfg, rows):
    return np.random.default_rng(0).integers(0, cfg.vocab, (rows, cfg.seq_len + 1)).astype(np.int32)


def test_ulysses_step_lowers_for_cuda_with_its_all_to_alls():
    from zerojax.models import gpt
    cfg = gpt.GPTConfig(vocab=32, n_layer=1, d_model=16, n_head=4, seq_len=8)
    toks = gpt_tokens(cfg, 8)
    state, step = zj.initialize(gpt.init_params(cfg, jax.random.PRNGKey(0)), gpt.loss_fn(cfg),
                                zj.ZeroConfig(stage=3, sequence_parallel_size=2, param_persistence_threshold=0),
                                optimizer=optax.adamw(1e-3))
    traced = step.trace(state, {"inputs": toks[:, :-1], "labels": toks[:, 1:]})
    assert collectives(check_cuda(traced))["all_to_all"] >= 4


def test_pipeline_step_lowers_for_cuda_with_its_sends():
    from zerojax.models import gpt
    from zerojax.models.gpt_pipeline import gpt_pipeline, init_pipeline_params
    cfg = gpt.GPTConfig(vocab=32, n_layer=2, d_model=16, n_head=2, seq_len=4)
    state = zj.shard_train_state(init_pipeline_params(cfg, jax.random.PRNGKey(0)), optax.adamw(1e-3),
                                 mesh=zj.make_mesh((2, 4), ("pipe", "data")),
                                 config=zj.ZeroConfig(stage=1, gradient_accumulation_steps=2))
    traced = zj.make_train_step(gpt_pipeline(cfg), state).trace(state, {"tokens": gpt_tokens(cfg, 16)})
    assert collectives(check_cuda(traced))["collective_permute"] > 0


# --------------------------------------------------------------------------- the checks can fail
def test_control_a_host_callback_is_refused_or_flagged():
    traced = jax.jit(lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2).trace(
        jnp.zeros(4, jnp.float32))
    problems = cuda_problems(traced)
    assert problems and ("custom calls a GPU lacks" in problems[0] or "does not lower" in problems[0])


def test_control_the_native_host_kernel_is_flagged_where_it_would_reach_a_gpu(monkeypatch):
    """The offloaded step before its host update followed the lowering platform: the native
    host kernel's custom call (CPU only) in the CUDA program."""
    import zerojax.stages._device_step as device_step
    monkeypatch.setattr(device_step, "lowered_on_cpu_as", lambda cpu_fn, other_fn: cpu_fn)
    problems = cuda_problems(traced_step(stage=2, offload_optimizer="cpu"), host_memory=True)
    assert any("zerojax_host_adamw" in p for p in problems), problems


def test_control_a_kernel_left_in_interpret_mode_is_flagged(monkeypatch):
    """The fused step as it was when the machine, not the target, chose interpret mode."""
    import zerojax.kernels._fused_update as fused_update
    monkeypatch.setattr(fused_update, "fused_adamw", functools.partial(fused_update.fused_adamw, interpret=True))
    problems = cuda_problems(traced_step(fused_adam=True, stage=2, precision="bf16"), gpu_kernel=True)
    assert any("no GPU kernel" in p for p in problems), problems


def test_control_memory_kinds_and_collectives_are_compared():
    assert any("missing" in p for p in cuda_problems(traced_step(stage=2), host_memory=True))
    assert any("where nothing is offloaded" in p for p in cuda_problems(traced_step(stage=2, offload_optimizer="cpu")))
    mesh = zj.make_mesh()

    def total(x):  # a sum over the devices on CPU only: the CUDA program lost its all-reduce
        summed = shard_map(lambda v: jax.lax.psum(v, "data"), mesh, in_specs=P("data"), out_specs=P())
        return jax.lax.platform_dependent(x, cpu=summed, default=lambda v: v[:1])

    problems = cuda_problems(jax.jit(total).trace(jnp.zeros(8, jnp.float32)))
    assert any("collectives differ" in p for p in problems), problems


needs_plugin = pytest.mark.skipif(cuda_plugin() is None, reason="JAX's CUDA plugin is not installed")


@needs_plugin
def test_control_offloaded_state_in_device_memory_is_flagged_in_the_gpu_program():
    """The offloaded step compiled over compile-only devices as jit does it: they list no memories,
    so JAX drops the state's pinned_host kind and the program keeps it in GPU memory."""
    from tests.helpers import init_params
    state = zj.abstract_train_state(jax.eval_shape(init_params, jax.random.PRNGKey(0)), adamw(),
                                    mesh=zj.make_mesh(devices=h100s()),
                                    config=zj.ZeroConfig(stage=2, offload_optimizer="cpu"))
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches(1)[0])
    compiled = zj.make_train_step(loss_fn, state).lower(state, batch).compile()
    problems = gpu_program_problems(compiled, host_memory=True)
    assert any("0 bytes of host arguments" in p for p in problems), problems
    # lowered over CPU devices for CUDA, the same step keeps its host arguments
    assert not cuda_problems(traced_step(stage=2, offload_optimizer="cpu"), host_memory=True)


def test_control_synchronous_collectives_and_foreign_calls_are_flagged():
    class Program:  # a scheduled GPU module as text, with one all-reduce run without a start/done pair
        def as_text(self):
            return ('ENTRY %main (a: f32[8]) -> f32[8] {\n'
                    '  %a = f32[8]{0} parameter(0)\n'
                    '  %c = f32[8]{0} custom-call(%a), custom_call_target="zerojax_host_adamw"\n'
                    '  ROOT %r = f32[8]{0} all-reduce(%c), channel_id=1, to_apply=%add\n}\n')

        def memory_analysis(self):
            return type("Stats", (), {"host_argument_size_in_bytes": 0})()

    problems = gpu_program_problems(Program())
    if not xla_makes_idle_collectives_synchronous():
        assert any("synchronous collectives {'all-reduce': 1}" in p for p in problems), problems
    assert any("custom calls no GPU runs: ['zerojax_host_adamw']" in p for p in problems), problems


@pytest.mark.slow  # more programs of the same engines: combinations the quick tier covers one at a time
def test_combinations_lower_for_cuda():
    from zerojax._compat import pallas_call_lowers_for_cuda
    if pallas_call_lowers_for_cuda(pallas_gpu_backend()):
        check_cuda(traced_step(fused_adam=True, stage=3, precision="fp16", param_persistence_threshold=0),
                   gpu_kernel=True)
        check_cuda(traced_step(fused_adam=True, stage=1), gpu_kernel=True)
    check_cuda(traced_step(stage=3, offload_optimizer="cpu", offload_ratio=0.5, param_persistence_threshold=0),
               host_memory=True)
    check_cuda(traced_step(stage=3, precision="bf16", quantized_weights=True, quantized_gradients=True,
                           param_persistence_threshold=0))
    check_cuda(traced_step(stage=3, precision="bf16", offload_optimizer="cpu", param_persistence_threshold=0),
               host_memory=True)
