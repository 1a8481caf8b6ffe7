"""zerojax._compat's bridges between the JAX versions zerojax supports (jax 0.10.2 to 0.12, see the
README's tested environments). Each test checks what the bridge gives on the installed JAX and,
where this JAX is one the bridge exists for, that the plain call it replaces fails here: the
bridge is what makes the rest of the suite pass on it."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import zerojax as zj
from zerojax import _compat


def _host_update(g, m):
    new_m = m * 0.5 + g  # state: stays in host memory
    return (new_m * 2.0).astype(jnp.float32), new_m


def _offloaded_step(host_call):
    mesh = zj.make_mesh()
    dev = NamedSharding(mesh, P("data"))
    host = dev.with_memory_kind("pinned_host")

    @jax.jit
    def step(g, m):
        p, new_m = host_call(_host_update)(jax.device_put(g, host), m)
        return jax.device_put(p, dev), new_m

    g = jax.device_put(jnp.arange(16.0), dev)
    m = jax.device_put(jnp.ones(16), host)
    return step(g, m)


def test_compute_on_host_keeps_each_outputs_memory_space():
    p, new_m = _offloaded_step(_compat.compute_on_host)
    assert new_m.sharding.memory_kind == "pinned_host" and p.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(new_m), 0.5 + np.arange(16.0))
    np.testing.assert_array_equal(np.asarray(p), 1.0 + 2 * np.arange(16.0))
    if _compat.compute_on_takes_memory_spaces():  # jax 0.12: the call the bridge replaces fails
        plain = lambda fn: _compat._compute_on()("device_host")(jax.jit(fn))  # noqa: E731
        with pytest.raises(TypeError, match="out_memory_spaces"):
            _offloaded_step(plain)


def test_known_xla_flags_keeps_the_known_and_drops_the_unknown():
    known, unknown = "--xla_backend_optimization_level=0", "--xla_zerojax_no_such_flag=1"
    assert _compat.known_xla_flags([known, unknown]) == [known]
    assert _compat.known_xla_flags([]) == []
    # what the filter saves the suite from: XLA aborts a process that starts with an unknown flag
    env = dict(os.environ, XLA_FLAGS=f"{known} {unknown}", JAX_PLATFORMS="cpu")
    child = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode != 0 and "xla_zerojax_no_such_flag" in child.stderr


def test_an_abstract_mesh_made_automatic_stays_abstract():
    mesh = AbstractMesh((4, 2), ("data", "model"))
    auto = _compat.automatic(mesh)
    assert isinstance(auto, AbstractMesh) and dict(auto.shape) == {"data": 4, "model": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in auto.axis_types)
    # the estimator plans on such a mesh: 512 devices this machine does not have
    report = zj.estimate({"w": jax.ShapeDtypeStruct((1024, 512), jnp.float32)}, 512, zj.ZeroConfig(stage=3))
    assert report.max_bytes() > 0
    if mesh.axis_types != auto.axis_types:  # jax 0.12: explicit by default, and no devices to rebuild it from
        with pytest.raises(ValueError, match="devices"):
            jax.sharding.Mesh(mesh.devices, mesh.axis_names)


def test_inlined_calls_are_read_from_either_form_of_jits_inline_parameter():
    closed = jax.make_jaxpr(lambda x: jnp.linalg.norm(x) + jnp.mean(x))(jnp.ones((4, 3)))
    calls = [e for e in closed.jaxpr.eqns if e.primitive is _compat._jit_p()]
    assert [e.params["name"] for e in calls] == ["norm"]  # jnp.mean is inlined where staged, norm is not
    assert not _compat.inlined_call(calls[0].primitive, calls[0].params)
    assert _compat._inlined_where_staged(True) and not _compat._inlined_where_staged(False)
    inline = getattr(jax, "Inline", None)
    if inline is not None:  # jax 0.12: an enum, every member truthy
        assert _compat._inlined_where_staged(inline.JAX_EARLY)
        assert not any(_compat._inlined_where_staged(m) for m in inline if m is not inline.JAX_EARLY)
        assert bool(calls[0].params["inline"])  # what a plain truth test would have taken as inlined


def test_a_step_wrapper_is_a_step():
    from zerojax._contract import Step, StepWrapper

    class Inner:
        plan = "the plan"

        def __call__(self, state, batch):
            return state, {}

        def lower(self, state, batch):
            return "lowered"

        def finish(self, state):
            return state

        def close(self):
            pass

    class Wrapped(StepWrapper):
        def __init__(self, step):
            self.step = step

        def __call__(self, state, batch):
            return self.step(state, batch)

    wrapped = Wrapped(Inner())
    assert isinstance(wrapped, Step)  # Python 3.12+ looks Protocol members up statically
    assert wrapped.plan == "the plan" and wrapped.lower(None, None) == "lowered"


def test_only_the_compile_options_this_xla_knows_are_kept():
    from zerojax._compat import known_compile_options
    from zerojax.stages._device_step import OVERLAP_OPTIONS

    made_up = {"xla_gpu_enable_no_such_thing": True}
    with pytest.raises(Exception, match="No such compile option"):  # the control: XLA refuses it
        jax.jit(lambda x: x + 1, compiler_options=made_up).lower(np.float32(0)).compile()
    kept = known_compile_options({**made_up, **OVERLAP_OPTIONS["gpu"]})
    assert "xla_gpu_enable_no_such_thing" not in kept and kept["xla_gpu_enable_latency_hiding_scheduler"] is True
    # every option kept compiles together
    jax.jit(lambda x: x + 1, compiler_options=kept).lower(np.float32(0)).compile()
