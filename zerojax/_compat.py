"""The one place that bridges JAX API differences between the versions zerojax supports."""
from __future__ import annotations

import contextlib
import enum
import functools
import threading

import jax
import numpy as np
from jax.sharding import Mesh

try:  # jax >= 0.6: a public shard_map with check_vma / axis_names
    _shard_map = jax.shard_map
    _NEW_SHARD_MAP = True
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NEW_SHARD_MAP = False

try:
    from jax.sharding import AxisType

    _AUTO = AxisType.Auto
except ImportError:  # pragma: no cover
    AxisType = None
    _AUTO = None


def shard_map(f, mesh, in_specs, out_specs, manual_axes=None):
    """shard_map with per-device (unchecked) replication semantics.

    ``manual_axes``: the mesh axes the body handles by hand; the others stay automatic
    (so a model-parallel axis keeps working inside a data-parallel body).
    """
    manual = frozenset(manual_axes) if manual_axes is not None else frozenset(mesh.axis_names)
    if _NEW_SHARD_MAP:
        kwargs = {}
        if manual != frozenset(mesh.axis_names):
            kwargs["axis_names"] = set(manual)
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **kwargs)
    auto = frozenset(mesh.axis_names) - manual  # pragma: no cover
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False, auto=auto)


def mesh_from_devices(devices: np.ndarray, axis_names) -> Mesh:
    """A Mesh whose axes are all automatic (GSPMD may place what we don't place by hand)."""
    if _AUTO is not None:
        return Mesh(devices, tuple(axis_names), axis_types=(_AUTO,) * len(axis_names))
    return Mesh(devices, tuple(axis_names))  # pragma: no cover


def automatic(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis automatic (the same devices and names). JAX's own ``jax.make_mesh``
    makes explicit axes, under which jnp operations type their operands' shardings and refuse
    the hand-placed collectives of a ZeRO step; zerojax places by hand and leaves the rest to
    GSPMD, so it builds its programs over the automatic view."""
    types = getattr(mesh, "axis_types", None)
    if _AUTO is None or not types or all(t == _AUTO for t in types):
        return mesh
    if not isinstance(mesh, Mesh):  # an AbstractMesh: no devices (its axes are explicit by default from jax 0.12)
        return abstract_mesh(mesh.axis_sizes, mesh.axis_names)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(_AUTO,) * len(mesh.axis_names))


def abstract_mesh(axis_sizes, axis_names):
    """An AbstractMesh (a mesh's shape without devices) whose axes are all automatic, as
    :func:`mesh_from_devices`'s: jax 0.12 makes an AbstractMesh's axes explicit unless told."""
    from jax.sharding import AbstractMesh

    sizes, names = tuple(int(s) for s in axis_sizes), tuple(axis_names)
    if _AUTO is not None:
        return AbstractMesh(sizes, names, axis_types=(_AUTO,) * len(names))
    return AbstractMesh(sizes, names)  # pragma: no cover


def primitives():
    """The control-flow and call primitives the stage-3 program rewriter looks inside."""
    from jax.extend.core import primitives as p

    calls = tuple(x for x in (_jit_p(), getattr(p, "closed_call_p", None), getattr(p, "core_call_p", None)) if x)
    return {"scan": p.scan_p, "while": p.while_p, "calls": calls}


def scan_counts(params) -> tuple:
    """``(num_consts, num_carry)`` of a ``scan`` equation's ``params``: given as such up to jax 0.11;
    jax 0.12 gives the consts, carry and xs as the three parts of a flat tree (``ft_in``)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _jit_p():
    from jax.extend.core import primitives as p

    return getattr(p, "jit_p", None) or getattr(p, "pjit_p", None)


def inlined_call(primitive, params) -> bool:
    """Whether an equation (its ``primitive`` and ``params``) is a ``jit`` call that JAX inlines
    where it is staged (``inline=True``, no shardings or layouts of its own): ``jax.numpy``'s
    functions, kept as calls by :func:`make_jaxpr_keeping_calls`."""
    return (primitive is _jit_p() and _inlined_where_staged(params.get("inline"))
            and not params.get("compiler_options_kvs")
            and all(type(s).__name__ == "UnspecifiedValue" for s in params.get("in_shardings", ()))
            and all(type(s).__name__ == "UnspecifiedValue" for s in params.get("out_shardings", ()))
            and all(x is None for x in params.get("in_layouts", ()))
            and all(x is None for x in params.get("out_layouts", ())))


def _inlined_where_staged(inline) -> bool:
    """Whether a ``jit`` call's ``inline`` parameter inlines it where it is staged: ``True`` up to
    jax 0.11; from jax 0.12 a ``jax.Inline`` whose ``JAX_EARLY`` does (its ``AUTO``, a truthy enum
    member, keeps the call, and ``jit(inline=True)`` is ``JAX_LATE``: inlined when lowered)."""
    if isinstance(inline, enum.Enum):
        return inline.name == "JAX_EARLY"
    return bool(inline)


def make_jaxpr_keeping_calls(fn, *args):
    """``jax.make_jaxpr(fn, return_shape=True)(*args)``, except that the inlined ``jit`` calls
    ``fn`` makes itself (``jax.numpy``'s functions) stay calls in the jaxpr: binding such a call
    again under a gradient reuses JAX's linearization of its (cached) program, where its inlined
    primitives would each be linearized anew. Only the calls staged into ``fn``'s own trace are
    kept: calls inside them, and the programs JAX caches for them, are traced as usual. Where
    JAX's staging rule for ``jit`` cannot be reached or used, this is plain ``make_jaxpr``."""
    try:
        from jax._src import core as _core
        from jax._src.interpreters import partial_eval as pe

        jit_p = _jit_p()
        current = lambda: _core.trace_ctx.trace  # noqa: E731
        ref = getattr(_core, "Ref", None)
    except (ImportError, AttributeError):  # pragma: no cover - a JAX without them
        return jax.make_jaxpr(fn, return_shape=True)(*args)
    if jit_p not in pe.custom_staging_rules:  # pragma: no cover
        return jax.make_jaxpr(fn, return_shape=True)(*args)
    top = []

    def traced(*xs):
        top.append(current())
        return fn(*xs)

    def keep(trace, source_info, *xs, **params):
        consts = getattr(params.get("jaxpr"), "consts", ())
        refs = ref is not None and any(isinstance(c, ref) for c in consts)  # the rule moves them
        if top and trace is top[0] and not refs and inlined_call(jit_p, params):
            return trace.default_process_primitive(jit_p, xs, params, source_info=source_info)
        return rule(trace, source_info, *xs, **params)

    with _STAGING:  # one swap at a time: each restores the rule it found
        rule = pe.custom_staging_rules[jit_p]
        pe.custom_staging_rules[jit_p] = keep
        try:
            return jax.make_jaxpr(traced, return_shape=True)(*args)
        except Exception:  # a JAX whose staging differs: traced as usual below (fn's own error recurs)
            pass
        finally:
            pe.custom_staging_rules[jit_p] = rule
    return jax.make_jaxpr(fn, return_shape=True)(*args)


_STAGING = threading.RLock()


try:  # the tracer type: public in jax.core today, kept reachable if it moves
    Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover
    from jax._src.core import Tracer  # noqa: F401


def _compute_on():
    try:
        from jax.experimental.compute_on import compute_on
    except ImportError:  # pragma: no cover - if it leaves experimental
        compute_on = jax.compute_on
    return compute_on


def compute_on_takes_memory_spaces() -> bool:
    """Whether this JAX's ``compute_on`` asks for its outputs' memory spaces (``compute_type=`` and
    ``out_memory_spaces=``, keyword-only: jax 0.12) rather than taking the compute type alone and
    typing each output as the computation left it (earlier)."""
    import inspect

    return "out_memory_spaces" in inspect.signature(_compute_on()).parameters


def compute_on_host(fn):
    """Run ``fn`` (traced inside a jitted step) on the host CPU of the device that owns the data.
    Each output stays in the memory space ``fn`` gives it (host state homed to host memory, the
    params sent back to the device in device memory): where ``compute_on`` asks for the outputs'
    memory spaces, they are read from a trace of ``fn`` on the same arguments."""
    compute_on = _compute_on()
    jitted = jax.jit(fn)
    if not compute_on_takes_memory_spaces():
        return compute_on("device_host")(jitted)

    def run(*args):
        closed, shapes = jax.make_jaxpr(jitted, return_shape=True)(*args)
        treedef = jax.tree_util.tree_structure(shapes)
        spaces = treedef.unflatten([aval.memory_space for aval in closed.out_avals])
        return compute_on(jitted, compute_type="device_host", out_memory_spaces=spaces)(*args)

    return run


def same_memory_space(x, like):
    """``x`` moved (while tracing) to the memory space of ``like`` where they differ: values an
    optimizer creates from constants inside a host computation are typed as device values."""
    space = getattr(jax.typeof(like), "memory_space", None)
    if space is None or getattr(jax.typeof(x), "memory_space", None) == space:
        return x
    return jax.device_put(x, space)


def backends_are_initialized() -> bool:
    """Whether jax has created its backends (after which device counts and collectives are fixed)."""
    try:
        from jax._src.xla_bridge import backends_are_initialized as initialized
    except ImportError:  # moved: jax.distributed.initialize raises its own error instead
        return False
    return bool(initialized())


def distributed_is_initialized() -> bool:
    """Whether ``jax.distributed.initialize`` has run in this process."""
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None:
        return bool(is_initialized())
    from jax._src.distributed import global_state  # a jax without the public query

    return global_state.client is not None


def to_device_memory(x):
    """``x`` moved (while tracing) from host memory to device memory; device values unchanged."""
    space = getattr(jax.typeof(x), "memory_space", None)
    if space is None or space == jax.memory.Space.Device:
        return x
    return jax.device_put(x, jax.memory.Space.Device)


def cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled program as one dict ("flops", "bytes accessed", ...):
    older jax returns a list with one dict per program, newer jax the dict."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if not cost:  # a program for compile-only devices has none: XLA's HloCostAnalysis of its module
        try:
            from jax._src.lib import _jax

            module = compiled.runtime_executable().hlo_modules()[0]
            cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        except (ImportError, AttributeError, IndexError, RuntimeError):  # pragma: no cover
            cost = {}
    return dict(cost or {})


# the event JAX records for each program it compiles (or reads from the persistent cache)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# ... for tracing a function to a jaxpr and lowering it to MLIR, and for a persistent-cache hit
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def count_compiles():
    """The names of the programs compiled (or read from the persistent cache) inside the block,
    from JAX's own monitoring event."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            seen.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def not_persisted():
    """A block whose compiled programs are not written to JAX's persistent compilation cache
    (the threshold of compile seconds a program must pass to be written, set out of reach)."""
    try:
        from jax._src import config as _config

        return _config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a jax without the state
        return contextlib.nullcontext()


def persisting_breaks(plan) -> bool:
    """Whether ``plan``'s step must stay out of the persistent compilation cache: on CPU devices, a
    step over a "seq" axis whose checkpoints go to host memory (``cpu_checkpointing``) compiles and
    runs, but the same program read back from the cache deadlocks in its collectives (the devices
    of one group wait at different all-gathers / all-to-alls until XLA aborts the process). With
    the layers in a ``lax.scan`` a fresh compile over "seq" can deadlock the same way on a busy
    machine, host checkpoints or not (the runtime orders a loop's all-to-alls and an outside
    collective differently per device); the suite trains that case with the layers as a Python
    loop (docs/long-context.md). And with jax 0.12, a multi-process job's step on CPU devices read
    back from the cache waits forever in its first collective (a job restarted by ``zerojax launch
    --max-restarts`` hung in its first step, where a fresh compile runs), so steps of a
    multi-process job on CPU devices stay out of it too."""
    if plan.mesh.devices.flat[0].platform != "cpu":
        return False
    block = plan.config.activation_checkpointing or {}
    return (plan.mesh.shape.get("seq", 1) > 1 and bool(block.get("cpu_checkpointing"))) or jax.process_count() > 1


def known_xla_flags(flags, python: str | None = None) -> list:
    """The flags of ``flags`` (each ``--name=value``) that this JAX's XLA knows. XLA reads
    ``XLA_FLAGS`` when the first backend starts and aborts the process on a flag it does not know
    (flags come and go between releases: jax 0.12's XLA has no ``--xla_cpu_use_fusion_emitters``),
    so they are tried in a child process, which names every unknown flag in the line it aborts
    with. ``python``: the interpreter to try them in (this one by default)."""
    import os
    import re
    import subprocess
    import sys

    flags = [f for f in flags if f]
    if not flags:
        return []
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    out = subprocess.run([python or sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode == 0:
        return flags
    match = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", out.stderr)
    if match is None:  # it failed for another reason: no flag is shown to be known
        return []
    unknown = {f.split("=", 1)[0] for f in match.group(1).split()}
    return [f for f in flags if f.split("=", 1)[0] not in unknown]


# XLA's CPU backend compiles a small program about 2.5x faster with its older emitters and no
# LLVM optimisation; zerojax's probe programs (optimizer recognition, a gated pass's check) are a
# few dozen scalar operations on a handful of values, run once each, so only their compile counts
_PROBE_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=None)
def probe_options():
    """Those of :data:`_PROBE_OPTIONS` this XLA accepts (jax 0.12's has no older emitters), on a
    CPU backend; None where it accepts none, or off CPU."""
    if jax.default_backend() != "cpu":
        return None

    def accepted(options):
        try:
            jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
        except Exception:  # noqa: BLE001 - an XLA without the option: compile as usual
            return False
        return True

    if accepted(_PROBE_OPTIONS):
        return _PROBE_OPTIONS
    options = {k: v for k, v in _PROBE_OPTIONS.items() if accepted({k: v})}
    return options or None


_KNOWN_OPTIONS: dict = {}  # option name -> whether this XLA knows it


def _compile_option_known(name: str, value) -> bool:
    """Whether XLA knows the option ``name``, tried once per name (with the first value seen:
    every bucket size a config gives a threshold would otherwise be a probe compile of its own)."""
    if name not in _KNOWN_OPTIONS:
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(np.float32(0)).compile()
            _KNOWN_OPTIONS[name] = True
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error type
            if "No such compile option" not in str(e):
                raise
            _KNOWN_OPTIONS[name] = False
    return _KNOWN_OPTIONS[name]


def known_compile_options(options: dict) -> dict:
    """The XLA options of ``options`` (by name, as ``jax.jit(compiler_options=...)`` takes them)
    that this XLA knows: options come and go between releases (jax 0.12's XLA has no
    ``xla_gpu_enable_pipelined_all_gather`` / ``_reduce_scatter`` / ``_all_reduce``), and an
    unknown one fails the compile. Each name is tried once, on a one-op CPU program (XLA checks
    the names whatever the backend)."""
    return {k: v for k, v in options.items() if _compile_option_known(k, v)}


def probe_jit(fn):
    """``jax.jit(fn)`` for a small program run once on probe values: compiled with
    :func:`probe_options` where there are any, elsewhere as usual."""
    options = probe_options()
    return jax.jit(fn, compiler_options=options) if options else jax.jit(fn)


# Pallas's GPU backends: Triton (deprecated in JAX 0.11, where Mosaic GPU is the default) and
# Mosaic GPU (which from JAX 0.12 runs through its own kernel API: pallas_call on a GPU is Triton)
_TRITON_DEPRECATED_FROM = (0, 11)


def pallas_gpu_backend() -> str:
    """The Pallas backend zerojax's ``pallas_call`` kernels use on an NVIDIA GPU: ``"mosaic_gpu"``
    where Triton is deprecated (from JAX 0.11) and this JAX's ``pallas_call`` lowers Mosaic GPU
    kernels (not from JAX 0.12); otherwise ``"triton"``, where this JAX has it."""
    if (tuple(jax.__version_info__[:2]) >= _TRITON_DEPRECATED_FROM or triton_params(4, 2) is None) \
            and pallas_call_lowers_for_cuda("mosaic_gpu"):
        return "mosaic_gpu"
    return "triton" if triton_params(4, 2) is not None else "mosaic_gpu"


@functools.lru_cache(maxsize=None)
def pallas_call_lowers_for_cuda(backend: str) -> bool:
    """Whether this JAX lowers a one-block ``pallas_call`` for CUDA with ``backend``'s compiler
    params (``"triton"`` or ``"mosaic_gpu"``) in this process: jax 0.12's ``pallas_call`` has no
    Mosaic GPU lowering, and lowers Triton only where it sees a GPU (or an abstract one in a mesh
    context), so a CPU-only machine cannot lower it there."""
    import warnings

    from jax.experimental import pallas as pl

    params = triton_params(4, 2) if backend == "triton" else mosaic_gpu_params()
    if params is None:
        return False

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), np.float32), compiler_params=params)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            jax.jit(fn).trace(jax.ShapeDtypeStruct((128,), np.float32)).lower(lowering_platforms=("cuda",))
    except Exception:  # noqa: BLE001 - no such lowering here
        return False
    return True


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler params for ``pallas_call``, wherever this JAX keeps them (None without
    Triton). Passing them also picks the Triton backend over Mosaic GPU."""
    try:
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):
        pass
    try:  # pragma: no cover - older jax releases
        from jax.experimental.pallas import gpu as plgpu

        return plgpu.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):
        return None


def mosaic_gpu_params():
    """Mosaic GPU compiler params for ``pallas_call`` (None where this JAX has no Mosaic GPU
    module, which leaves the choice to JAX's default)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plmgpu

        return plmgpu.CompilerParams()
    except (ImportError, AttributeError):  # pragma: no cover
        return None


def lowered_on_cpu_as(cpu_fn, other_fn):
    """A function that is ``cpu_fn`` in a program lowered for CPU and ``other_fn`` in one lowered
    for any other platform (``jax.lax.platform_dependent``: both are traced, only the target's
    is lowered), whatever machine traces it: a CPU-only construct (a host kernel's custom call)
    never reaches a GPU program traced on a CPU machine."""

    def fn(*args):
        return jax.lax.platform_dependent(*args, cpu=cpu_fn, default=other_fn)

    return fn


# Fields XLA's GpuTargetConfigProto gained after some jaxlib releases: a jaxlib that does not know
# one refuses the whole text ("Failed to parse GpuTargetConfigProto"; jaxlib 0.10.2 does not know
# collective_memory_granularity, which XLA's own target files carry).
_NEWER_GPU_TARGET_FIELDS = ("collective_memory_granularity",)


def gpu_topology(target_config: str, topology: str):
    """Compile-only CUDA devices for ``topology`` ("partitions x hosts x GPUs per host", e.g.
    ``"1x1x8"``) of the GPU that ``target_config`` (a GpuTargetConfigProto in text form)
    describes: ``jax.experimental.topologies.get_topology_desc``, retried without the fields
    this jaxlib does not parse where it refuses the text."""
    import os
    import tempfile

    from jax.experimental import topologies

    # XLA logs the parse error on the process's stderr before raising: keep it out of sight
    # unless the retry is no answer to it
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            return topologies.get_topology_desc(platform="cuda", target_config=target_config, topology=topology)
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime error type
            if "GpuTargetConfigProto" not in str(e):
                os.dup2(saved, 2)
                log.seek(0)
                os.write(2, log.read())
                raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    kept = [line for line in target_config.splitlines()
            if line.strip().split(":", 1)[0] not in _NEWER_GPU_TARGET_FIELDS]
    return topologies.get_topology_desc(platform="cuda", target_config="\n".join(kept), topology=topology)


def cuda_plugin():
    """The name of the CUDA plugin JAX would load here (``"cuda12"``, ``"cuda13"``), or None."""
    import importlib.util

    for major in ("cuda13", "cuda12"):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_{major}") is not None:
                return major
        except (ImportError, ValueError):  # pragma: no cover - a broken namespace package
            continue
    return None


class CompiledFor:
    """A program XLA compiled for compile-only devices from a module lowered elsewhere: the
    parts of ``jax.stages.Compiled`` a plan reads."""

    def __init__(self, executable):
        self._executable = executable

    def memory_analysis(self):
        return self._executable.get_compiled_memory_stats()

    def as_text(self) -> str:
        return self._executable.hlo_modules()[0].to_string()

    def runtime_executable(self):
        return self._executable

    def cost_analysis(self):
        return None  # cost_analysis() below reads the module with XLA's HloCostAnalysis


def compile_lowered_for(lowered, devices, options=None) -> CompiledFor:
    """Compile ``lowered`` (a ``jax.stages.Lowered`` of an SPMD program over ``len(devices)``
    devices, lowered for their platform) for ``devices``, compile-only devices of a GPU
    topology, in the order of the mesh it was lowered over.

    A step over compile-only devices cannot carry memory kinds (they list no memories, so JAX
    drops ``pinned_host`` from its shardings and the offloaded state lands in device memory);
    lowered over the same mesh of CPU devices for ``lowering_platforms=("cuda",)`` it keeps
    them, and this compiles that module with the GPU topology's compiler. ``options``: XLA
    options by name, as ``jax.jit(compiler_options=...)`` takes them."""
    from jax._src import compiler
    from jax._src.lib import xla_client as xc

    n = len(devices)
    compile_options = compiler.get_compile_options(num_replicas=1, num_partitions=n,
                                                   device_assignment=np.array(devices).reshape(1, n),
                                                   env_options_overrides=dict(options or {}))
    executable = devices[0].client.compile(lowered.compiler_ir("stablehlo"),
                                           executable_devices=xc.DeviceList(tuple(devices)),
                                           compile_options=compile_options)
    return CompiledFor(executable)
