"""Tensor parallelism from a Flax NNX model's annotations, ZeRO stage 3 over the data axis.

8 simulated CPU devices as a data x model = 4 x 2 mesh. The MLP's kernels are annotated with
``nnx.with_partitioning``: the first layer's columns and the second layer's rows are split over
"model" (Megatron's column / row split). ZeRO keeps those splits and partitions each leaf's free
dimension over "data", so a device stores 1/8 of every big kernel and its Adam state.

    python examples/train_tensor_parallel.py [--steps 50]
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zerojax as zj  # noqa: E402

D_IN, D_HID, D_OUT = 64, 512, 16


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(D_IN, D_HID, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)))
        self.down = nnx.Linear(D_HID, D_OUT, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", None)))

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64, help="global batch (a multiple of the data axis, 4)")
    args = ap.parse_args()

    mesh = zj.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):  # the annotations shard the fresh params over "model" as they are created
        model = MLP(nnx.Rngs(0))
    params, specs, merge = zj.nnx_params(model)
    # fp32: on the CPU backend a bf16 step on a 2-D mesh fails to compile (XLA's AllReducePromotion
    # pass: "Invalid binary instruction opcode copy")
    config = zj.ZeroConfig(stage=3, precision="fp32", param_persistence_threshold=0)
    state = zj.shard_train_state(params, optax.adamw(3e-3), mesh=mesh, config=config, param_specs=specs)

    def loss_fn(p, batch):
        return jnp.mean((merge(p)(batch["x"]) - batch["y"]) ** 2)

    step = zj.make_train_step(loss_fn, state)
    for lay in state.plan.leaves:
        print(f"{lay.path:<18} {str(lay.shape):<12} stored as {lay.spec(lay.params_partitioned, 'data')}")
    print(zj.memory_report(state))

    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(D_IN, D_OUT)).astype(np.float32) / np.sqrt(D_IN)
    for i in range(args.steps):
        x = rng.normal(size=(args.batch, D_IN)).astype(np.float32)
        state, metrics = step(state, {"x": x, "y": np.tanh(x @ teacher)})
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
