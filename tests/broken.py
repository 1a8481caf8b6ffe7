"""Deliberately broken variants of library pieces, for the negative controls: a control
monkeypatches one in (inside the test only) and asserts that the check it guards then fails.

Each rule of the step pipeline has one home (:mod:`zerojax.update._pipeline`), so breaking it
there breaks it on every path: the device step, fused Adam, optimizer offload, NVMe, ZenFlow
and ``zero_optimizer``."""
import jax
import jax.numpy as jnp

from zerojax.offload import _host_update as host_update
from zerojax.stages import _device_step as device_step, _update as update
from zerojax.update import _pipeline


def invert_clipping(monkeypatch) -> None:
    """Gradients multiplied by the clip coefficient instead of divided by it."""
    real = _pipeline.clip_coefficient
    monkeypatch.setattr(_pipeline, "clip_coefficient", lambda norm, clip, *rest: 1.0 / real(norm, clip, *rest))


def never_skip(monkeypatch) -> None:
    """Steps with inf/nan gradients are applied instead of skipped."""
    monkeypatch.setattr(_pipeline, "skip_rule",
                        lambda cfg, finite: jnp.asarray(False) if isinstance(finite, jax.Array) else False)


def update_without_master(monkeypatch) -> None:
    """The update (on the device and the in-step host update) keeps no more than 16 bits: the
    master is rounded to the compute dtype before and after every update, as if the 16-bit
    params were updated in place."""
    real = update.optax_update

    def broken(plan, tx, master, grads, opt_state, key=None, value=None):
        def to16(tree):
            return jax.tree_util.tree_map(lambda x: x.astype(plan.compute_dtype).astype(x.dtype), tree)

        master, opt_state = real(plan, tx, to16(master), grads, opt_state, key, value)
        return to16(master), opt_state

    for module in (device_step, host_update):
        monkeypatch.setattr(module, "optax_update", broken)
    # the gated passes would bypass optax_update: keep both updates on the general path
    for module in (device_step, host_update):
        monkeypatch.setattr(module, "plan_recipe", lambda plan, tx: None)
