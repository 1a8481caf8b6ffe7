"""AutoTP: tensor-parallel PartitionSpecs inferred from a model's leaf names, as DeepSpeed's AutoTP.

DeepSpeed's ``"tensor_parallel": {"autotp_size": N}`` (``ZeroConfig(autotp_size=N)``) splits the
attention and MLP projections of a transformer over N devices with no change to the model. Here
that is a ``("data", "model")`` mesh of ``world / N x N`` devices and, per leaf, a PartitionSpec
over ``"model"`` chosen from the name of the layer that owns the leaf:

* column-parallel (output features split): q/k/v (``q_proj``, ``k_proj``, ``v_proj``, ``query``,
  ``key``, ``value``), ``gate_proj``, ``up_proj``, GPT-2's ``c_attn`` and ``c_fc``; their biases too;
* row-parallel (input features split; XLA all-reduces the output): ``o_proj``, ``down_proj``,
  ``out_proj``, GPT-2's ``c_proj``; their biases stay whole;
* with ``vocab_parallel=True``, the token embedding (``embed_tokens``, ``wte``, ...) and
  ``lm_head`` split along the vocabulary;
* einsum attention weights with a heads dimension (tunix, MaxText, gemma: ``q_proj`` /
  ``query`` / ``q_einsum`` ``[d_model, heads, head_dim]`` or ``[heads, d_model, head_dim]``,
  ``kv_einsum`` ``[2, kv_heads, d_model, head_dim]``, ``o_proj`` / ``out`` / ``attn_vec_einsum``
  ``[heads, head_dim, d_model]``): q/k/v split by heads (column parallel, a ``[heads, head_dim]``
  bias too), the output projection by heads on its input side (row parallel). Which dim holds the
  heads is read against the d_model of the block's output projection. kv heads that do not
  divide N stay whole (DeepSpeed splits whole heads unevenly, which a sharding cannot);
* everything else (norms, position embeddings, leaves no rule covers) stays replicated on
  ``"model"``, and so does a covered leaf whose split dimension does not divide N. The
  weights (2-D and up) left whole are named in one :class:`AutoTPCoverageWarning` when a plan
  is built.

A Flax ``Dense``/``nnx.Linear`` kernel is ``[in, out]``. Hugging Face's Flax GPT-2 keeps its
Conv1D kernels ``[out, in]`` (``c_attn`` is ``[3 * hidden, hidden]``): the orientation of the
GPT-2 names is read from the ``c_attn`` kernel's shape. A leaf the user annotated already
(``param_specs`` or the array's own NamedSharding naming a mesh axis) keeps its annotation.
ZeRO then partitions every leaf's free dimension over ``"data"`` as usual (:mod:`zerojax._plan`)::

    state, step = zj.initialize(params, loss_fn, {"train_micro_batch_size_per_gpu": 2,
                                "tensor_parallel": {"autotp_size": 2},
                                "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW"}})
    print(autotp_describe(params, 2))   # which rule split which leaf
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Optional, Tuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._errors import AutoTPCoverageWarning, ConfigError
from zerojax._mesh import MODEL, SEQ, make_mesh

__all__ = ["COLUMN", "MODEL", "ROW", "VOCAB", "TPLeaf", "autotp_describe", "autotp_leaves", "autotp_mesh",
           "autotp_size_of", "autotp_specs", "check_autotp_mesh", "check_cpu_precision", "mesh_for", "plan_specs",
           "sequence_parallel_size_of"]


# layer names -> how AutoTP splits them (Hugging Face / Flax spellings; Meta's Llama w1/w2/w3, wq/wk/wv/wo)
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj", "query_key_value",
                    "gate_proj", "up_proj", "gate_up_proj", "c_attn", "c_fc", "wq", "wk", "wv", "w1", "w3",
                    "fc1", "fc_in", "dense_h_to_4h"})
ROW = frozenset({"o_proj", "down_proj", "out_proj", "c_proj", "wo", "w2", "fc2", "fc_out", "dense_4h_to_h"})
VOCAB = frozenset({"embed_tokens", "wte", "word_embeddings", "tok_embeddings", "embed_in", "lm_head", "embed_out",
                   "embedder"})  # tunix's and gemma's embedder/input_embedding [vocab, d_model]
_GPT2 = frozenset({"c_attn", "c_fc", "c_proj"})  # Conv1D-style names whose orientation is read from c_attn
# einsum attention weights with a heads dimension (tunix, MaxText, gemma, Flax's DenseGeneral): the
# query/key/value names split by heads (column parallel), the output names by heads on their input side
HEAD_COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q_einsum",
                         "k_einsum", "v_einsum", "kv_einsum", "qkv_einsum"})
HEAD_ROW = frozenset({"o_proj", "out_proj", "wo", "out", "o_einsum", "attn_vec_einsum"})
_HEADS_FIRST = frozenset({"q_einsum", "k_einsum", "v_einsum", "kv_einsum", "qkv_einsum"})  # gemma: [heads, d, hd]
_PARAM_NAMES = frozenset({"kernel", "bias", "weight", "embedding", "scale", "w"})
_BOX = frozenset({"value", "raw_value"})  # NNX Variable attributes that may end a path


@dataclasses.dataclass(frozen=True)
class TPLeaf:
    """What AutoTP decided for one leaf.

    ``rule``: "column", "row", "vocab", "user" (the user's annotation kept) or "replicated";
    ``dim``: the dimension split over ``"model"`` (None when none is); ``why``: one line."""

    path: str
    shape: Tuple[int, ...]
    rule: str
    dim: Optional[int]
    why: str

    def spec(self, user_spec) -> Optional[P]:
        if self.rule == "user":
            return user_spec
        entries = [None] * len(self.shape)
        if self.dim is not None:
            entries[self.dim] = MODEL
        return P(*entries)


# --------------------------------------------------------------------------- mesh
def autotp_mesh(autotp_size: int, devices=None, data_axis: str = "data") -> Mesh:
    """A ``(data_axis, "model")`` mesh of ``len(devices) // autotp_size x autotp_size``; the
    devices of one tensor-parallel group are consecutive (on a GPU host: one node's NVLink)."""
    devices = list(jax.devices() if devices is None else devices)
    if autotp_size < 1 or len(devices) % autotp_size:
        raise ConfigError(f"autotp_size={autotp_size} (tensor_parallel.autotp_size) does not divide the "
                          f"{len(devices)} devices: the mesh is world / autotp_size data-parallel groups of "
                          f"autotp_size devices. Fix: use a divisor of {len(devices)}")
    return make_mesh((len(devices) // autotp_size, autotp_size), (data_axis, MODEL), devices)


_BUILDERS = "zj.initialize, zj.shard_train_state, zj.abstract_train_state and zj.zero_optimizer build it"


def check_autotp_mesh(mesh: Mesh, autotp_size: int, data_axis: str = "data") -> None:
    """ConfigError unless ``mesh`` has a ``"model"`` axis of ``autotp_size`` devices beside the data axis."""
    if autotp_size <= 1:
        return
    shape = dict(mesh.shape)
    size = shape.get(MODEL)
    if size != autotp_size or data_axis not in shape:
        got = f"a {MODEL!r} axis of {size}" if size is not None else f"no {MODEL!r} axis"
        built = f"zj.autotp_mesh({autotp_size}" + (")" if data_axis == "data" else f", data_axis={data_axis!r})")
        if data_axis not in shape:
            other = ""
        elif size is None:
            other = ", or set autotp_size=1 (AutoTP off) to train on this mesh"
        else:
            other = f", or set autotp_size={size} (this mesh's {MODEL!r} size)"
        raise ConfigError(
            f"autotp_size={autotp_size} (tensor_parallel.autotp_size) needs a mesh with a {data_axis!r} axis and a "
            f"{MODEL!r} axis of {autotp_size} devices, but the mesh has axes {shape} ({got}). Fix: leave mesh unset "
            f"(mesh=None: {_BUILDERS}) or pass mesh={built}{other}")


def _raw(config) -> dict:
    """A DeepSpeed dict, or the one read from a JSON path with the reader's own loading (its errors
    name the file); {} for anything else."""
    if isinstance(config, (str, os.PathLike)):
        from zerojax.config._deepspeed import _load
        config = _load(config)
    return config if isinstance(config, dict) else {}


def _size(value) -> int:
    """A size key's value, or 1 for a value the reader will refuse (it says why, not this)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def autotp_size_of(config) -> int:
    """The ``autotp_size`` of a ZeroConfig, a DeepSpeed dict or a DeepSpeed JSON path (1 when
    absent; a value the reader will refuse reads as 1 here)."""
    if hasattr(config, "autotp_size"):
        return int(config.autotp_size)
    block = _raw(config).get("tensor_parallel")
    return _size(block.get("autotp_size", 1) if isinstance(block, dict) else 1)


def sequence_parallel_size_of(config) -> int:
    """The ``sequence_parallel_size`` of a ZeroConfig, a DeepSpeed dict or a DeepSpeed JSON path
    (1 when absent; a value the reader will refuse reads as 1 here)."""
    if hasattr(config, "sequence_parallel_size"):
        return int(config.sequence_parallel_size)
    return _size(_raw(config).get("sequence_parallel_size", 1))


def _check_seq_mesh(mesh: Mesh, sp: int) -> None:
    size = dict(mesh.shape).get(SEQ, 1)
    if sp > 1 and size != sp:
        other = (f"sequence_parallel_size={size} (this mesh's {SEQ!r} size)" if size > 1
                 else "sequence_parallel_size=1 (off)")
        raise ConfigError(
            f"sequence_parallel_size={sp} needs a mesh with a {SEQ!r} axis of {sp} devices, but the mesh has axes "
            f"{dict(mesh.shape)}. Fix: leave mesh unset (mesh=None: {_BUILDERS}), or set {other} to train on "
            f"this mesh")


def mesh_for(config, mesh=None) -> Mesh:
    """The mesh ``zj.initialize``, ``zj.shard_train_state``, ``zj.abstract_train_state`` and
    ``zj.zero_optimizer`` train on: ``mesh`` checked against the config's autotp_size and
    sequence_parallel_size, or, when None, built from them: every device on ``"data"`` (both 1),
    ``("data", "seq")`` for sequence parallelism, ``("data", "model")`` for AutoTP, or
    ``("data", "seq", "model")`` for both (one tensor-parallel group on consecutive devices)."""
    size, sp = autotp_size_of(config), sequence_parallel_size_of(config)
    data_axis = getattr(config, "data_axis", "data")
    if mesh is not None:
        check_autotp_mesh(mesh, size, data_axis)
        _check_seq_mesh(mesh, sp)
        return mesh
    if sp <= 1:
        return make_mesh() if size <= 1 else autotp_mesh(size, data_axis=data_axis)
    devices = jax.devices()
    world = len(devices)
    if world % (sp * max(size, 1)):
        raise ConfigError(
            f"sequence_parallel_size={sp} does not divide the {world // max(size, 1)} devices"
            + (f" left by tensor_parallel.autotp_size={size}" if size > 1 else "")
            + f": the mesh is world / sequence_parallel_size data-parallel groups of sequence_parallel_size "
            f"devices. Fix: use a divisor of {world // max(size, 1)}")
    if size <= 1:
        return make_mesh((world // sp, sp), (data_axis, SEQ), devices)
    return make_mesh((world // (sp * size), sp, size), (data_axis, SEQ, MODEL), devices)


# --------------------------------------------------------------------------- rules
def _parts(path) -> list:
    if len(path) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name in _BOX:
        path = path[:-1]  # an nnx.Variable's .value, whatever the Variable's name (tunix: input_embedding)
    parts = jax.tree_util.keystr(path, simple=True, separator="/").split("/")  # as zerojax._plan.path_str
    while len(parts) > 1 and parts[-1] in _BOX and parts[-2] in _PARAM_NAMES:
        parts.pop()  # nnx.State paths end in the Variable's .value
    return parts


def _layer_of(parts) -> Tuple[Optional[str], str]:
    """(the name of the layer owning the leaf, the leaf's own name)."""
    if len(parts) < 2:
        return None, parts[-1] if parts else ""
    return parts[-2], parts[-1]


def _gpt2_out_first(flat) -> bool:
    """Whether GPT-2-style kernels are [out, in] (Hugging Face's Flax GPT-2: c_attn is [3h, h])."""
    for parts, leaf in flat:
        layer, name = _layer_of(parts)
        shape = tuple(getattr(leaf, "shape", ()))
        if layer == "c_attn" and len(shape) == 2 and name != "bias":
            return shape[0] == 3 * shape[1]
    return False


def _widths(flat) -> dict:
    """d_model of each attention block, by the path above its layers, read from its einsum output
    projection ``[heads, head_dim, d_model]``: it tells which dim of a ``[a, b, head_dim]`` query
    weight holds the heads (``[d_model, heads, head_dim]`` in tunix and MaxText, ``[heads,
    d_model, head_dim]`` in gemma)."""
    out = {}
    for parts, leaf in flat:
        layer, name = _layer_of(parts)
        shape = tuple(getattr(leaf, "shape", ()))
        if layer in HEAD_ROW and len(shape) == 3 and name != "bias":
            out["/".join(parts[:-2])] = int(shape[2])
    return out


def _heads(path: str, parts, shape, n: int, width: Optional[int]) -> Optional[TPLeaf]:
    """The heads rule for an einsum attention weight (3-D, or 4-D with a leading q/k/v stack of 2 or
    3), or None where it does not apply: query/key/value split by heads (column parallel), the
    output projection ``[heads, head_dim, d_model]`` by heads on its input side (row parallel)."""
    layer, name = _layer_of(parts)
    if layer in HEAD_ROW and len(shape) == 3 and name != "bias":
        kind, dim, what = "row", 0, f"row-parallel {layer} [heads, head_dim, d_model] (heads, its input side)"
    elif layer in HEAD_COLUMN and len(shape) == 2 and name == "bias":
        kind, dim, what = "column", 0, f"bias [heads, head_dim] of column-parallel {layer}"
    elif layer in HEAD_COLUMN and len(shape) in (3, 4) and name != "bias":
        stack = len(shape) - 3  # gemma's kv_einsum [2, kv_heads, d, hd], qkv_einsum [3, heads, d, hd]
        if stack and shape[0] not in (2, 3):
            return None
        a, b = stack, stack + 1  # [..., a, b, head_dim]: one of a, b is d_model, the other the heads
        if width is not None and (shape[a] == width) != (shape[b] == width):
            dim = b if shape[a] == width else a
        else:
            dim = a if layer in _HEADS_FIRST else b
        kind, what = "column", f"column-parallel {layer} (heads)"
    else:
        return None
    if shape[dim] % n:
        kv = layer in HEAD_COLUMN and layer not in ("q_proj", "query", "wq", "q_einsum", "qkv_einsum")
        why = (f"{what}: {shape[dim]} {'kv ' if kv else ''}heads (dim {dim}) do not divide autotp_size {n}: left "
               f"whole on {MODEL!r}")
        if kv:
            why += (" (each device computes every kv head, as Megatron-LM keeps kv heads whole when there are "
                    "fewer than the TP ranks; the query heads stay split)")
        return TPLeaf(path, shape, "replicated", None, why)
    return TPLeaf(path, shape, kind, dim, f"{what}: dim {dim} split over {MODEL!r}")


def _user_spec(leaf, user_spec, data_axis: str):
    """The user's annotation when it names a mesh axis other than the data axis, else None."""
    spec = user_spec
    if spec is None:
        sharding = getattr(leaf, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else None
    if spec is None:
        return None
    names = [n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None and n != data_axis]
    return spec if names else None


def _decide(path: str, parts, leaf, n: int, out_first: bool, vocab_parallel: bool,
            width: Optional[int] = None) -> TPLeaf:
    shape = tuple(int(s) for s in leaf.shape)
    layer, name = _layer_of(parts)
    matrix = len(shape) == 2
    heads = _heads(path, parts, shape, n, width)
    if heads is not None:
        return heads
    if layer in COLUMN or layer in ROW:
        kind = "column" if layer in COLUMN else "row"
        flipped = out_first and layer in _GPT2  # [out, in]
        if len(shape) == 1 and name == "bias":
            if kind == "row":
                return TPLeaf(path, shape, "replicated", None, f"bias of row-parallel {layer}: whole, added after "
                                                               "the all-reduce")
            dim, what = 0, f"bias of column-parallel {layer}"
        elif matrix:
            out_dim, in_dim = (0, 1) if flipped else (1, 0)
            dim = out_dim if kind == "column" else in_dim
            what = f"{kind}-parallel {layer} ({'out' if dim == out_dim else 'in'} features)"
        else:
            return TPLeaf(path, shape, "replicated", None, f"{layer}: a {len(shape)}-D leaf, no rule for its layout")
    elif vocab_parallel and layer in VOCAB and matrix:
        kind = "vocab"
        # an embedding table is [vocab, hidden]; a Dense head's kernel [hidden, vocab]
        dim = 0 if name == "embedding" or layer != "lm_head" else 1
        what = f"vocabulary-parallel {layer}"
    else:
        why = "no AutoTP rule" if layer not in VOCAB else "vocabulary leaf (vocab_parallel off)"
        return TPLeaf(path, shape, "replicated", None, why)
    if shape[dim] % n:
        return TPLeaf(path, shape, "replicated", None, f"{what}: dim {dim} of size {shape[dim]} does not divide "
                                                       f"autotp_size {n}")
    return TPLeaf(path, shape, kind, dim, f"{what}: dim {dim} split over {MODEL!r}")


def autotp_leaves(params, autotp_size: int, param_specs=None, *, vocab_parallel: bool = False,
                  data_axis: str = "data") -> list:
    """One :class:`TPLeaf` per leaf of ``params`` (arrays or ShapeDtypeStructs), in flatten order."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    user = treedef.flatten_up_to(param_specs) if param_specs is not None else [None] * len(flat)
    named = [(_parts(path), leaf) for path, leaf in flat]
    out_first = _gpt2_out_first(named)
    widths = _widths(named)
    out = []
    for (parts, leaf), spec in zip(named, user):
        path = "/".join(parts)
        if not hasattr(leaf, "shape"):
            raise ConfigError(f"param {path!r} is a {type(leaf).__name__}, not an array; only arrays may be leaves")
        given = _user_spec(leaf, spec, data_axis)
        if given is not None:
            out.append(TPLeaf(path, tuple(leaf.shape), "user", None, f"the user's annotation {given}"))
        else:
            out.append(_decide(path, parts, leaf, autotp_size, out_first, vocab_parallel,
                               widths.get("/".join(parts[:-2]))))
    return out


def autotp_specs(params, autotp_size: int, param_specs=None, *, vocab_parallel: bool = False,
                 data_axis: str = "data"):
    """The ``param_specs`` tree AutoTP gives ``params``: the user's annotations where given,
    the rules' ``"model"`` splits elsewhere, ``P()`` (replicated) for the rest."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    user = treedef.flatten_up_to(param_specs) if param_specs is not None else [None] * len(flat)
    user = [_user_spec(leaf, s, data_axis) for (_, leaf), s in zip(flat, user)]
    leaves = autotp_leaves(params, autotp_size, param_specs, vocab_parallel=vocab_parallel, data_axis=data_axis)
    return treedef.unflatten([lay.spec(u) for lay, u in zip(leaves, user)])


def autotp_describe(params, autotp_size: int, param_specs=None, *, vocab_parallel: bool = False) -> str:
    """A table: each leaf, its shape and what AutoTP did with it."""
    rows = [f"AutoTP over {autotp_size} devices on {MODEL!r}"]
    for lay in autotp_leaves(params, autotp_size, param_specs, vocab_parallel=vocab_parallel):
        rows.append(f"  {lay.path:<44} {str(lay.shape):<14} {lay.rule:<10} {lay.why}")
    return "\n".join(rows)


_CPU_PASS = "all-reduce-promotion"


def check_cpu_precision(mesh: Mesh, config, axis: str = MODEL) -> None:
    """On the CPU backend XLA's all-reduce promotion pass aborts the process (a failed check,
    not an exception) when it meets a 16-bit reduction over the data axis inside a step whose
    body leaves another mesh axis (``axis``: AutoTP's "model", Ulysses' "seq") to the
    partitioner; refuse with the way out instead. Under "model" both 16-bit formats abort;
    under "seq" bf16 does (fp16 compiles)."""
    if mesh.devices.flat[0].platform != "cpu" or _CPU_PASS in os.environ.get("XLA_FLAGS", ""):
        return
    if config.precision == "fp32" or (axis == SEQ and config.precision != "bf16"):
        return
    setting = (f"autotp_size={config.autotp_size}" if axis == MODEL
               else f"sequence_parallel_size={mesh.shape[SEQ]} (a {SEQ!r} mesh axis)")
    raise ConfigError(
        f"{setting} with precision {config.precision!r} on the CPU backend: XLA's {_CPU_PASS} pass aborts the "
        f"process while compiling a 16-bit step on a {tuple(mesh.axis_names)} mesh. Fix: train in fp32 on the CPU "
        f"({'bf16/fp16' if axis == MODEL else 'bf16'} disabled), or set XLA_FLAGS=--xla_disable_hlo_passes={_CPU_PASS} before jax is imported")


def warn_whole(leaves, autotp_size: int) -> None:
    """One :class:`AutoTPCoverageWarning` naming every weight (2-D and up) AutoTP leaves whole on
    ``"model"``, with the reason; nothing when it leaves none. 1-D leaves (norm scales, biases of
    row-parallel layers) are meant to stay whole and are not listed."""
    whole = [lay for lay in leaves if lay.rule == "replicated" and len(lay.shape) >= 2]
    if not whole:
        return
    split = sum(lay.rule in ("column", "row", "vocab", "user") for lay in leaves)
    listed = "; ".join(f"{lay.path} {lay.shape}: {lay.why}" for lay in whole)
    warnings.warn(
        f"AutoTP (autotp_size={autotp_size}) splits {split} leaves over {MODEL!r} and leaves {len(whole)} "
        f"weight{'s' if len(whole) != 1 else ''} whole on it (every device of a tensor-parallel group stores "
        f"and computes them in full): "
        f"{listed}. Where that matters, annotate them (param_specs=, or nnx.with_partitioning / "
        f"nn.with_partitioning read by zj.nnx_params / zj.linen_params with rules=), or set "
        f"vocab_parallel_lm_head for the embedding and head; zj.autotp_describe(params, {autotp_size}) lists "
        f"every leaf", AutoTPCoverageWarning, stacklevel=4)


def plan_specs(params, mesh: Mesh, config, param_specs=None) -> Any:
    """What :meth:`zerojax._plan.ZeroPlan.create` plans with under ``config.autotp_size`` > 1:
    the mesh checked, and the AutoTP specs with the user's annotations kept; the weights it leaves
    whole are named in an :class:`AutoTPCoverageWarning`."""
    check_autotp_mesh(mesh, config.autotp_size, config.data_axis)
    check_cpu_precision(mesh, config)
    warn_whole(autotp_leaves(params, config.autotp_size, param_specs, vocab_parallel=config.autotp_vocab_parallel,
                             data_axis=config.data_axis), config.autotp_size)
    return autotp_specs(params, config.autotp_size, param_specs, vocab_parallel=config.autotp_vocab_parallel,
                        data_axis=config.data_axis)
