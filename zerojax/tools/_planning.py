"""plan_step: compile the real ZeRO step for N devices from shapes alone, on any machine.

``plan_step`` builds the abstract train state (``abstract_train_state``), the step
(``make_train_step``), lowers and compiles it for a mesh of N devices and reads what the compiler
made of it: peak bytes per device, temporaries, collectives, next to the stored bytes of
``zj.estimate``. Nothing is allocated, so a 70B model plans on a laptop::

    cfg = GPTConfig(n_layer=24, d_model=2048, n_head=16, seq_len=2048, scan=True)
    plan = zj.plan_step(functools.partial(gpt.init_params, cfg), zj.Ref("zerojax.models.gpt:loss_fn", cfg),
                        {"tokens": jax.ShapeDtypeStruct((64, 2049), jnp.int32)},
                        devices=64, config=zj.ZeroConfig(stage=3, precision="bf16"))
    print(plan)

When this process has fewer than N devices the compilation runs in a child Python process on N
simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, ``JAX_PLATFORMS=cpu``):
device counts are fixed when jax starts, so no other way exists. The child receives the request
by ``pickle``, so ``init_fn``, ``loss_fn`` and ``tx`` must then be importable by reference:

* module-level functions (pickled as module + qualified name), ``functools.partial`` of them;
* ``"package.module:function"`` strings;
* ``Ref("package.module:factory", *args)``, which calls ``factory(*args)`` in the child: for loss
  functions and optimizers built by a factory (``Ref("optax:adamw", 1e-3)``), since closures
  cannot be sent.

Lambdas and closures work in-process only. The figures are the CPU backend's: the layout and the
collectives are the real step's, the temporaries are what XLA's CPU scheduler keeps alive.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Mapping, Optional, Union

import jax
import numpy as np

from zerojax.config import ZeroConfig
from zerojax._errors import ConfigError, ZeroJaxError
from zerojax._mesh import make_mesh
from zerojax.models import gpt
from zerojax.models.gpt import GPTConfig
from zerojax.runtime._launch import with_device_count
from zerojax.stages._zeropp import node_size
from zerojax._state import abstract_train_state
from zerojax._step import make_train_step
from zerojax._compat import cost_analysis, cuda_plugin
from zerojax.tools._compiled import (
    CommReport,
    PeakMemory,
    collectives,
    node_map,
    overlap,
    program_custom_calls,
    theory_elements,
)
from zerojax.stages._device_step import compiler_options
from zerojax.tools._gpu import GPUS_PER_HOST, can_compile_here, compile_for_target, gpu_target, missing_plugin
from zerojax.tools._estimate import estimate

_STDERR_TAIL = 4000


def gpt_sizes():
    """Named GPT shapes for planning (``zerojax plan --model``, benchmarks/scale.py): stacked layers."""
    return {
        "gpt2-small": GPTConfig(vocab=50257, n_layer=12, d_model=768, n_head=12, seq_len=1024, scan=True),
        "gpt-1.3b": GPTConfig(vocab=50257, n_layer=24, d_model=2048, n_head=16, seq_len=2048, scan=True),
        "gpt-7b": GPTConfig(vocab=50257, n_layer=32, d_model=4096, n_head=32, seq_len=2048, scan=True),
        "gpt-70b": GPTConfig(vocab=50257, n_layer=80, d_model=8192, n_head=64, seq_len=2048, scan=True),
    }


def named_gpt(model: str, seq_len: Optional[int] = None):
    """``(cfg, init_fn, loss_fn)`` of a :func:`gpt_sizes` model (``seq_len`` overrides its
    sequence length); both functions pickle, so :func:`plan_step` can compile them in a child."""
    cfg = gpt_sizes()[model]
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq_len)
    return cfg, functools.partial(gpt.init_params, cfg), Ref("zerojax.models.gpt:loss_fn", cfg)


def _import(target: str):
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{target!r} is not an importable reference: write 'package.module:function'")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"cannot import module {module!r} of {target!r}: {e}") from e
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"module {module!r} has no attribute {name!r} (from {target!r})") from None
    return obj


@dataclasses.dataclass(frozen=True, init=False)
class Ref:
    """An importable callable, or what an importable factory returns when called with ``args``.

        Ref("optax:adamw", 1e-3)                     # -> optax.adamw(1e-3), built where it is used
        Ref("zerojax.models.gpt:loss_fn", cfg)       # -> gpt.loss_fn(cfg)
        Ref("mypkg.model:loss")                      # -> mypkg.model.loss itself
    """

    target: str
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs, so the Ref stays hashable and picklable

    def __init__(self, target: str, *args, **kwargs):
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", tuple(sorted(kwargs.items())))

    def resolve(self):
        obj = _import(self.target)
        if self.args or self.kwargs:
            return obj(*self.args, **dict(self.kwargs))
        return obj


def resolve(obj):
    """A Ref or 'module:function' string -> the object it names; anything else as is."""
    if isinstance(obj, Ref):
        return obj.resolve()
    if isinstance(obj, str):
        return _import(obj)
    return obj


@dataclasses.dataclass
class StepPlan:
    """What one compiled ZeRO step needs per device (bytes) and moves per step.

    peak_bytes = argument + output + temp - alias (``zj.peak_memory``'s definition); stored_bytes
    is the train state a device keeps between steps (``zj.estimate``, device memory only).
    """

    devices: int
    mesh_shape: Dict[str, int]
    n_params: int
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    stored_bytes: int
    stored_host_bytes: int  # offloaded state (pinned or unpinned host memory), most loaded device
    collective_bytes: int
    collective_elements: int
    theory_elements: float  # ZeRO's per-device volume for this stage (compiled.theory_elements)
    collectives: Dict[str, tuple]  # kind -> (count, bytes, elements) per device per step
    lower_seconds: float
    compile_seconds: float
    subprocess: bool
    platform: str = "cpu"
    comm: Optional[CommReport] = None  # the collectives in full: per span (inside / across nodes), re-priceable
    label: str = "zerojax"  # or "plain GSPMD FSDP" (plan_step(plain="fsdp"))
    # compiled for a GPU (target=...): the GPU, its memory and peaks, and what XLA:GPU scheduled
    target: Optional[str] = None
    gpu_memory_bytes: int = 0
    peak_flops: float = 0.0  # dense, at the step's precision
    hbm_bandwidth: float = 0.0  # bytes per second
    link_bandwidth: float = 0.0  # NVLink, one direction, bytes per second
    network_bandwidth: float = 0.0  # to other nodes, per GPU
    flops: float = 0.0  # XLA's count for the optimized program, per device (recomputation included)
    bytes_accessed: float = 0.0
    async_collectives: Dict[str, tuple] = dataclasses.field(default_factory=dict)  # kind -> (starts, overlapped)
    sync_collectives: int = 0
    host_argument_bytes: int = 0  # the program's arguments in host memory (offloaded state), per device
    host_temp_bytes: int = 0
    custom_calls: tuple = ()  # the custom-call targets of the compiled program, sorted

    @property
    def seconds(self) -> float:
        return self.lower_seconds + self.compile_seconds

    @property
    def fits(self) -> Optional[bool]:
        """Whether the per-device peak fits the target GPU's memory (None without a target)."""
        return None if not self.target else self.peak_bytes <= self.gpu_memory_bytes

    @property
    def overlapped(self) -> tuple:
        """(overlapped, asynchronous) collective starts: those with compute scheduled before their done."""
        return (sum(v[1] for v in self.async_collectives.values()), sum(v[0] for v in self.async_collectives.values()))

    @property
    def roofline(self) -> Dict[str, float]:
        """Seconds per step by each bound on the target: ``compute`` (XLA's flops at the dense
        peak), ``memory`` (its bytes accessed at HBM bandwidth), ``comm`` (what a device sends in
        its collectives' rings, NVLink inside a node and the network across nodes), and ``step``:
        the largest of them, the time when everything else hides behind it."""
        if not self.target:
            return {}
        comm = 0.0
        if self.comm is not None:
            comm = (self.comm.volume(span="inside", sent=True) / self.link_bandwidth
                    + self.comm.volume(span="across", sent=True) / self.network_bandwidth)
        out = {"compute": self.flops / self.peak_flops, "memory": self.bytes_accessed / self.hbm_bandwidth,
               "comm": comm}
        out["step"] = max(out.values())
        return out

    @property
    def mfu(self) -> Optional[float]:
        """XLA's flops over (roofline step time x peak): the utilisation the roofline allows."""
        r = self.roofline
        return self.flops / (r["step"] * self.peak_flops) if r and r["step"] else None

    @property
    def device_peak_bytes(self) -> int:
        """``peak_bytes`` in device memory alone: the CPU compiler places every memory kind in
        one address space, so there the offloaded state is taken out of its peak."""
        return self.peak_bytes - self.stored_host_bytes if self.platform == "cpu" else self.peak_bytes

    def __str__(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        if self.target:
            where = (f"for {self.devices} compile-only {self.target} GPUs by XLA:GPU"
                     + (" in a child process" if self.subprocess else ""))
        else:
            where = ("in a child process on simulated CPU devices" if self.subprocess
                     else f"on this process's {self.platform} devices")
        ratio = self.collective_elements / self.theory_elements if self.theory_elements else float("nan")
        count = f"{self.n_params / 1e9:.2f}B" if self.n_params >= 1e9 else f"{self.n_params / 1e6:.2f}M"
        return "\n".join([
            f"step plan{'' if self.label == 'zerojax' else ' (' + self.label + ')'}: {count} params on "
            f"{self.devices} devices ({mesh}), compiled {where} in "
            f"{self.seconds:.1f}s (lower {self.lower_seconds:.1f}s, compile {self.compile_seconds:.1f}s)",
            f"  peak per device       {_size(self.peak_bytes)} = arguments {_size(self.argument_bytes)}"
            f" + outputs {_size(self.output_bytes)} + temporaries {_size(self.temp_bytes)}"
            f" - aliased {_size(self.alias_bytes)}",
            f"  stored state          {_size(self.stored_bytes)} on device"
            + (f", {_size(self.stored_host_bytes)} on host" if self.stored_host_bytes else ""),
            f"  collectives per step  {_size(self.collective_bytes)} ({self.collective_elements / 1e6:.2f}M "
            f"elements; ZeRO theory {self.theory_elements / 1e6:.2f}M, ratio {ratio:.3f})",
        ] + self._gpu_lines())

    def _gpu_lines(self) -> list:
        if not self.target:
            return []
        margin = self.gpu_memory_bytes - self.peak_bytes
        verdict = (f"fits, {_size(margin)} to spare" if margin >= 0 else f"does NOT fit: {_size(-margin)} over")
        done, starts = self.overlapped
        r = self.roofline
        mfu = self.mfu
        return [
            f"  {self.target} memory          {_size(self.gpu_memory_bytes)} per GPU: the peak {verdict} "
            f"({self.peak_bytes / self.gpu_memory_bytes:.1%})"
            + (f"; host memory: arguments {_size(self.host_argument_bytes)}, temporaries {_size(self.host_temp_bytes)}"
               if self.host_argument_bytes or self.host_temp_bytes else ""),
            f"  overlap               {done} of {starts} async collectives have compute scheduled before their done"
            + (f"; {self.sync_collectives} synchronous" if self.sync_collectives else ""),
            f"  roofline per step     {r['step'] * 1e3:.2f} ms (compute {r['compute'] * 1e3:.2f}, memory "
            f"{r['memory'] * 1e3:.2f}, collectives {r['comm'] * 1e3:.2f}; {self.flops / 1e12:.3f} TFLOP per GPU)"
            + (f", MFU at most {mfu:.1%}" if mfu is not None else ""),
        ]


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.2f} KiB"


def _mesh_axes(devices: Optional[int], mesh_shape, config: ZeroConfig) -> Dict[str, int]:
    if mesh_shape is None:
        if devices is None:
            raise ConfigError("plan_step needs devices=N or mesh_shape={'data': N, ...}")
        axes = {config.data_axis: int(devices)}
    elif isinstance(mesh_shape, Mapping):
        axes = {str(k): int(v) for k, v in mesh_shape.items()}
    else:
        raise ConfigError(f"mesh_shape={mesh_shape!r} must be a mapping of axis sizes, e.g. "
                          f"{{'{config.data_axis}': 4, 'model': 2}}")
    total = math.prod(axes.values())
    if devices is not None and total != devices:
        raise ConfigError(f"mesh_shape {axes} holds {total} devices but devices={devices}; make them agree")
    if config.data_axis not in axes:
        raise ConfigError(f"mesh_shape {axes} has no {config.data_axis!r} axis for ZeRO to partition over")
    return axes


def _batch_spec(batch_shapes):
    """Batch leaves -> (shape, dtype name) pairs: plain data that pickles anywhere."""
    def one(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ConfigError(f"batch_shapes leaves must have .shape and .dtype (jax.ShapeDtypeStruct), got {x!r}")
        return (tuple(int(s) for s in x.shape), np.dtype(x.dtype).name)
    return jax.tree_util.tree_map(one, batch_shapes)


def _is_shape_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str) and isinstance(x[0], tuple)


def fsdp_spec(shape, n: int, axis: str):
    """Plain FSDP's split of one leaf: along its largest dimension that ``n`` divides, never the
    leading (layer) axis of a stacked leaf, which GSPMD would gather whole for a ``lax.scan``;
    replicated where none divides."""
    from jax.sharding import PartitionSpec as P

    dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d])
            if shape[d] % n == 0 and shape[d] >= n and not (len(shape) >= 3 and d == 0)]
    if not dims:
        return P()
    spec = [None] * len(shape)
    spec[dims[0]] = axis
    return P(*spec)


def _plain_fsdp_step(shapes, loss_fn, tx, mesh, axis: str, batch, has_aux: bool):
    """GSPMD's FSDP of the same model, as a JAX user writes it: params and optimizer state split
    by :func:`fsdp_spec`, one ``jax.jit`` of grad, update and apply. -> (traced step, stored
    bytes per device)."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]

    def sharded(tree):
        sh = jax.tree_util.tree_map(
            lambda x: NamedSharding(mesh, fsdp_spec(x.shape, n, axis) if x.ndim else P()), tree)
        return sh, jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)

    opt_shapes = jax.eval_shape(tx.init, shapes)
    (p_sh, p_args), (o_sh, o_args) = sharded(shapes), sharded(opt_shapes)
    b_sh = NamedSharding(mesh, P(axis))
    b_args = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=b_sh), batch)

    def step(params, opt_state, b):
        value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    jitted = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), donate_argnums=(0, 1),
                     out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))
    stored = sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                 for tree, sh in ((p_args, p_sh), (o_args, o_sh))
                 for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(sh)))
    return jitted.trace(p_args, o_args, b_args), int(stored)


def _plan_here(init_fn, loss_fn, batch_spec, axes: Dict[str, int], config: ZeroConfig, tx, param_specs,
               has_aux: bool, subprocess_: bool, target: Optional[str] = None, plain: Optional[str] = None) -> StepPlan:
    """Compile on this process's first prod(axes) devices, or for prod(axes) compile-only GPUs
    of ``target``."""
    import optax

    init_fn, loss_fn = resolve(init_fn), resolve(loss_fn)
    tx = optax.adamw(1e-3) if tx is None else resolve(tx)
    # for a GPU target the step is lowered over this process's CPU devices for CUDA (so that its
    # memory kinds hold) and compiled by XLA:GPU for the target's compile-only devices
    mesh = make_mesh(tuple(axes.values()), tuple(axes.keys()), devices=jax.devices("cpu") if target else None)
    shapes = jax.eval_shape(init_fn, jax.random.PRNGKey(0)) if callable(init_fn) else init_fn
    t0 = time.perf_counter()
    state = abstract_train_state(shapes, tx, mesh=mesh, config=config, param_specs=param_specs)
    batch = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s[0], np.dtype(s[1])), batch_spec,
                                   is_leaf=_is_shape_pair)
    if plain == "fsdp":
        traced, plain_stored = _plain_fsdp_step(shapes, loss_fn, tx, mesh, config.data_axis, batch, has_aux)
        options = {}
    elif plain is not None:
        raise ConfigError(f"plain={plain!r}: the plain baseline plan_step builds is 'fsdp' (GSPMD's FSDP)")
    else:
        step = make_train_step(loss_fn, state, has_aux=has_aux)
        traced, options = step.trace(state, batch), compiler_options(state.plan, "gpu")
    if target:
        lowered = traced.lower(lowering_platforms=("cuda",))
        t1 = time.perf_counter()
        compiled = compile_for_target(lowered, mesh, target, options)
    else:
        lowered = traced.lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
    t2 = time.perf_counter()
    m = compiled.memory_analysis()
    peak = PeakMemory(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                      m.alias_size_in_bytes)
    k = node_size(state.plan)
    if target and not config.devices_per_node and config.hpz_partition_size <= 1:
        # the target's GPUs sit in nodes of 8: its data-axis devices per node, the other axes inside
        k = max(1, min(state.plan.n, GPUS_PER_HOST * state.plan.n // mesh.devices.size))
    text = compiled.as_text()
    comm = collectives(text, node_map(mesh, config.data_axis, k), k)
    theory, label = (theory_elements(state.plan, config.gradient_accumulation_steps) if not plain
                     else (3.0 * sum(lay.size for lay in state.plan.leaves), "3Ψ"))  # gathered twice, reduced once
    comm.theory_elements, comm.theory_label = theory, label
    if plain:
        stored_device, host = plain_stored, 0
    else:
        stored = estimate(shapes, mesh, config, tx, param_specs=param_specs)
        stored_device = int(stored.max_bytes("device"))
        host = max((stored.max_bytes(k) for k in stored.kinds if k != "device"), default=0)
    gpu = {}
    if target:
        t, cost, sched = gpu_target(target), cost_analysis(compiled), overlap(text)
        gpu = dict(target=t.name, gpu_memory_bytes=t.memory_bytes, peak_flops=t.peak_flops(config.precision),
                   hbm_bandwidth=t.hbm_bandwidth, link_bandwidth=t.link, network_bandwidth=t.network,
                   flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                   async_collectives=dict(sched.kinds), sync_collectives=sum(sched.synchronous.values()),
                   host_argument_bytes=int(getattr(m, "host_argument_size_in_bytes", 0)),
                   host_temp_bytes=int(getattr(m, "host_temp_size_in_bytes", 0)),
                   custom_calls=tuple(sorted(program_custom_calls(text))))
    return StepPlan(
        devices=math.prod(axes.values()), mesh_shape=dict(axes),
        n_params=sum(lay.size for lay in state.plan.leaves),
        peak_bytes=int(peak.peak), argument_bytes=int(peak.argument), output_bytes=int(peak.output),
        temp_bytes=int(peak.temp), alias_bytes=int(peak.alias),
        stored_bytes=stored_device, stored_host_bytes=int(host),
        collective_bytes=int(comm.total_bytes), collective_elements=int(comm.total_elements),
        theory_elements=float(theory), collectives={k: tuple(int(x) for x in v) for k, v in comm.kinds.items()},
        lower_seconds=t1 - t0, compile_seconds=t2 - t1, subprocess=subprocess_,
        platform="cuda" if target else mesh.devices.flat[0].platform, comm=comm,
        label="plain GSPMD FSDP" if plain else "zerojax", **gpu,
    )


_CHILD_FAILED = """\
plan_step's child process ({what}) failed with exit code {rc}.
Its last lines of output:
{tail}
If the error is in your model, the same error shows in-process on a smaller device count;
if it is an import error, the callables must be importable from the child (see zerojax.tools._planning)."""


def _child_env(n: int) -> Dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), n)
    env["JAX_PLATFORMS"] = "cpu"
    # the child must import what the parent can: the same module search path
    env["PYTHONPATH"] = os.pathsep.join([p or os.getcwd() for p in sys.path])
    return env


def _plan_in_child(request: dict, n: int, timeout: Optional[float]) -> StepPlan:
    for name in ("init_fn", "loss_fn", "tx", "param_specs", "config"):
        try:
            pickle.dumps(request[name])
        except Exception as e:  # pickle raises several types for closures and lambdas
            raise ConfigError(
                f"plan_step for {n} devices compiles in a child process, and {name}={request[name]!r} cannot be "
                f"sent there ({type(e).__name__}: {e}). Pass a module-level function, a functools.partial of "
                "one, a 'package.module:function' string, or zj.Ref('package.module:factory', *args) for "
                "objects a factory builds (closures such as loss_fn(cfg), optax optimizers)."
            ) from None
    what = (f"compiling for {n} compile-only {request['target']} GPUs" if request.get("target")
            else f"simulating {n} CPU devices")
    with tempfile.TemporaryDirectory(prefix="zerojax-plan-") as tmp:
        req, out = os.path.join(tmp, "request.pkl"), os.path.join(tmp, "plan.pkl")
        with open(req, "wb") as f:
            pickle.dump(request, f)
        code = "import sys; from zerojax.tools._planning import _child_main; _child_main(sys.argv[1], sys.argv[2])"
        try:
            proc = subprocess.run([sys.executable, "-c", code, req, out], env=_child_env(n), capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            tail = ((e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))[-_STDERR_TAIL:]
            raise ZeroJaxError(f"plan_step's child process ({what}) ran past timeout={timeout}s."
                               f"\n{tail}") from None
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout or "(no output)")[-_STDERR_TAIL:]
            raise ZeroJaxError(_CHILD_FAILED.format(what=what, rc=proc.returncode, tail=tail))
        with open(out, "rb") as f:
            fields = pickle.load(f)
    if isinstance(fields.get("comm"), dict):  # dataclasses.asdict flattened it for the trip
        fields["comm"] = CommReport(**fields["comm"])
    return StepPlan(**fields)


def _child_main(request_path: str, out_path: str) -> None:
    with open(request_path, "rb") as f:
        r = pickle.load(f)
    n = math.prod(r["axes"].values())
    if not r.get("target") and len(jax.devices()) < n:  # pragma: no cover - the parent set the device count
        raise ZeroJaxError(f"child has {len(jax.devices())} devices, needs {n}; XLA_FLAGS={os.environ.get('XLA_FLAGS')}")
    plan = _plan_here(r["init_fn"], r["loss_fn"], r["batch"], r["axes"], r["config"], r["tx"], r["param_specs"],
                      r["has_aux"], True, r.get("target"), r.get("plain"))
    with open(out_path, "wb") as f:
        pickle.dump(dataclasses.asdict(plan), f)


def plan_step(
    init_fn: Union[Callable, str, Ref, Any],
    loss_fn: Union[Callable, str, Ref],
    batch_shapes,
    devices: Optional[int] = None,
    config: Optional[ZeroConfig] = None,
    tx=None,
    mesh_shape: Optional[Mapping[str, int]] = None,
    *,
    param_specs=None,
    has_aux: bool = False,
    timeout: Optional[float] = None,
    target: Optional[str] = None,
    plain: Optional[str] = None,
) -> StepPlan:
    """Compile the ZeRO train step for ``devices`` devices from shapes and report what it needs.

    ``init_fn(rng) -> params`` (or a params tree of ``jax.ShapeDtypeStruct``), ``loss_fn(params,
    batch)``, ``batch_shapes`` a tree of ``jax.ShapeDtypeStruct`` of the *global* batch (leading
    dimension devices x gradient_accumulation_steps x micro-batch). ``tx`` defaults to
    ``optax.adamw(1e-3)``; ``mesh_shape`` such as ``{"data": 4, "model": 2}`` adds model axes
    (default: one ``data`` axis of ``devices``). With fewer local devices than needed the step is
    compiled in a child process on simulated CPU devices (see the module docstring for what
    can be sent there); a failing child raises ``RuntimeError`` with the end of its stderr.

        plan = zj.plan_step(init_params, loss_fn, {"x": jax.ShapeDtypeStruct((64, 128), jnp.float32)},
                            devices=64, config=zj.ZeroConfig(stage=3, precision="bf16"))
        plan.peak_bytes, plan.stored_bytes, plan.collective_bytes

    ``target="h100"`` (or ``"h200"``, ``"a100"``: :data:`zerojax.tools._gpu.TARGETS`) compiles the
    step with XLA's GPU compiler for ``devices`` compile-only GPUs of that kind, in nodes of 8, on
    any machine: the peak is XLA:GPU's, ``plan.fits`` says whether it fits the GPU's memory, and
    the plan adds the scheduled collectives' overlap and a roofline estimate of the step time.
    This needs JAX's CUDA plugin; a process whose JAX platforms are not cpu-only compiles in a
    child process (with the same rules for what can be sent there).

    ``plain="fsdp"`` plans GSPMD's FSDP of the same model instead (a plain ``jax.jit`` step with
    params and optimizer state split along each leaf's largest dimension the device count
    divides, :func:`fsdp_spec`), for the same figures side by side; ``config`` then only names
    the data axis.
    """
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise ConfigError(f"config={config!r} is not a ZeroConfig: pass zj.ZeroConfig(stage=..., precision=...)")
    axes = _mesh_axes(devices, mesh_shape, config)
    n = math.prod(axes.values())
    batch = _batch_spec(batch_shapes)
    if target is not None:
        target = gpu_target(target).name
        if can_compile_here() and len(jax.devices("cpu")) >= n:
            return _plan_here(init_fn, loss_fn, batch, axes, config, tx, param_specs, has_aux, False, target, plain)
        if cuda_plugin() is None:  # say so here, not from a child
            raise missing_plugin(target)
    elif len(jax.devices()) >= n:
        return _plan_here(init_fn, loss_fn, batch, axes, config, tx, param_specs, has_aux, False, None, plain)
    if not callable(init_fn) and not isinstance(init_fn, (str, Ref)):
        init_fn = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype)), init_fn)
    request = {"init_fn": init_fn, "loss_fn": loss_fn, "batch": batch, "axes": axes, "config": config, "tx": tx,
               "param_specs": param_specs, "has_aux": has_aux, "target": target, "plain": plain}
    return _plan_in_child(request, n, timeout)


__all__ = ["Ref", "StepPlan", "gpt_sizes", "plan_step", "resolve"]
