"""Deliberately broken variants of library pieces, for the negative controls: a control
monkeypatches one in (inside the test only) and asserts that the check it guards then fails."""
import jax

from zerojax import optim
from zerojax.offload import host_update, nvme_step, zenflow
from zerojax.stages import device_step, update

# every module that imported clip_coefficient by name
CLIP_USERS = (update, device_step, nvme_step, zenflow, optim)


def invert_clipping(monkeypatch) -> None:
    """Gradients multiplied by the clip coefficient instead of divided by it."""
    real = update.clip_coefficient
    for module in CLIP_USERS:
        monkeypatch.setattr(module, "clip_coefficient", lambda norm, clip, *rest: 1.0 / real(norm, clip, *rest))


def update_without_master(monkeypatch) -> None:
    """The update (on the device and the in-step host update) keeps no more than 16 bits: the
    master is rounded to the compute dtype before and after every update, as if the 16-bit
    params were updated in place."""
    real = update.optax_update

    def broken(plan, tx, master, grads, opt_state, key=None):
        def to16(tree):
            return jax.tree_util.tree_map(lambda x: x.astype(plan.compute_dtype).astype(x.dtype), tree)

        master, opt_state = real(plan, tx, to16(master), grads, opt_state, key)
        return to16(master), opt_state

    for module in (device_step, host_update):
        monkeypatch.setattr(module, "optax_update", broken)
    # the gated passes would bypass optax_update: keep both updates on the general path
    for module in (device_step, host_update):
        monkeypatch.setattr(module, "plan_recipe", lambda plan, tx: None)
