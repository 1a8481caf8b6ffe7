"""Checkpoints: any mesh / stage / offload on restore, exact resume, crash safety, consolidation."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

import zerojax as zj
from tests._ckpt_worker import make_state
from tests.helpers import batches, init_params, loss_fn
from zerojax._plan import path_str
from zerojax.checkpoint import CheckpointError, CheckpointManager, consolidate
from zerojax.checkpoint import _manager as manager
from zerojax.checkpoint import _steps as steps
from zerojax.checkpoint._integrity import digest

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_ckpt_worker.py")
TX = lambda: optax.adamw(1e-2, weight_decay=0.1)


def host(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def logical_opt(state):
    """Optimizer leaves unpadded, on the host."""
    lays = state.plan.opt_leaf_layouts(state.opt_state, stored=True)
    out = []
    for x, lay in zip(jax.tree_util.tree_leaves(state.opt_state), lays):
        x = np.asarray(jax.device_get(x))
        out.append(x if lay is None else x[tuple(slice(0, s) for s in lay.shape)])
    return out


def assert_same(a, b):
    """Bitwise equal: params, optimizer state, step, loss scaler, rng."""
    for x, y in zip(host(a.full_params(jnp.float32)), host(b.full_params(jnp.float32))):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(logical_opt(a), logical_opt(b)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(host((a.step, a.loss_scale, a.rng)), host((b.step, b.loss_scale, b.rng))):
        np.testing.assert_array_equal(x, y)


def train(state, data):
    step = zj.make_train_step(loss_fn, state)
    for b in data:
        state, _ = step(state, b)
    return state


def abstract(n=8, **config):
    return zj.abstract_train_state(init_params(jax.random.PRNGKey(0)), TX(), mesh=zj.make_mesh(n),
                                   config=zj.ZeroConfig(**config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Stage 3, bf16, every leaf partitioned, 8 devices, 2 steps taken; checkpoint at step 2."""
    directory = str(tmp_path_factory.mktemp("ckpt"))
    state = train(make_state("fp32", precision="bf16"), batches(2))
    mngr = CheckpointManager(directory)
    mngr.save(2, state, data_state={"epoch": 1, "offset": 64})
    mngr.close()
    return directory, state


def test_checksums_summed_on_the_host_equal_the_programs(saved, tmp_path, monkeypatch):
    """On CPU devices save and restore sum the checksums with numpy; an accelerator sums them in
    the save and restore programs. Both give the same checksums (a split dimension's padding adds
    zeros): a step saved one way verifies when restored the other way."""
    from zerojax.checkpoint import _format as fmt

    directory, state = saved
    assert fmt.sums_on_host(state.plan) and any(lay.pad for lay in state.plan.leaves)
    _, on_host = fmt.logical_tree(state)
    monkeypatch.setattr(fmt, "sums_on_host", lambda plan: False)
    _, in_program = fmt.logical_tree(state)
    assert on_host["checksums"] == in_program["checksums"]
    for budget in (None, 1):  # the saved step (host sums) verifies with the programs' sums
        got, _ = zj.checkpoint.restore(directory, abstract(4, stage=3, precision="bf16", param_persistence_threshold=0),
                                       budget=budget)
        assert_same(got, state)


def test_compressed_and_plain_steps_restore_alike(saved, tmp_path):
    """Arrays are written uncompressed unless compress=True (zstd in the stored array's metadata);
    either restores to the same state."""
    from zerojax.checkpoint import _pieces

    directory, state = saved
    with CheckpointManager(tmp_path / "zstd", compress=True) as mngr:
        mngr.save(2, state)
    compressors = {}
    for name, d in (("plain", directory), ("zstd", str(tmp_path / "zstd"))):
        got, _ = zj.checkpoint.restore(d, abstract(8, stage=3, precision="bf16", param_persistence_threshold=0))
        assert_same(got, state)
        store = _pieces.open_array(os.path.join(d, "2", "state"), "params/dense/kernel", _pieces.context())
        compressors[name] = store.spec().to_json()["metadata"]["compressor"]
    assert compressors["plain"] is None and compressors["zstd"]["id"] == "zstd"
    with pytest.raises(zj.ZeroJaxError, match="compress"):
        CheckpointManager(tmp_path / "bad", compress="zstd")


@pytest.mark.parametrize("n,stage,offload", [(4, 3, None), (2, 0, None), (1, 3, None), (8, 1, None),
                                             (8, 2, None), (4, 2, "cpu")])
def test_restore_on_any_mesh_and_stage(saved, n, stage, offload):
    directory, state = saved
    target = abstract(n, stage=stage, precision="bf16", param_persistence_threshold=0, offload_optimizer=offload)
    restored, data_state = CheckpointManager(directory).restore(target)
    assert data_state == {"epoch": 1, "offset": 64}
    assert restored.plan.n == n and restored.plan.stage == stage
    assert_same(state, restored)
    # every leaf lands where the target plan puts it, in its dtype
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        assert got.sharding.memory_kind == want.sharding.memory_kind


def test_restore_into_fp32_run_and_back(saved):
    """A bf16 run's fp32 master becomes an fp32 run's params."""
    directory, state = saved
    restored, _ = CheckpointManager(directory).restore(abstract(2, stage=1))
    assert restored.master is None
    for x, y in zip(host(state.full_params(jnp.float32)), host(restored.full_params(jnp.float32))):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """Checkpoints written by a separate process after 5 steps, fp32 and fp16."""
    root = tmp_path_factory.mktemp("half")
    procs = {p: subprocess.Popen([sys.executable, WORKER, "half", str(root / p), p]) for p in ("fp32", "fp16")}
    for p in procs.values():
        assert p.wait(timeout=120) == 0
    return root


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_bitwise_exact(halves, precision):
    data = batches(10)
    straight = train(make_state(precision), data)
    target = make_state(precision)  # a fresh state object: only its layout is used
    resumed, data_state = CheckpointManager(halves / precision).restore(target)
    assert int(resumed.step) == 5 and data_state == {"next_batch": 5}
    if precision == "fp16":  # the scaler was mid-hysteresis when saved
        assert int(resumed.loss_scale.hysteresis) == 1
    resumed = train(resumed, data[int(data_state["next_batch"]):])
    assert_same(straight, resumed)


def _kill_mid_write(directory: str, first: int, timeout: float = 120.0) -> int:
    """Run the saving loop and SIGKILL it while a save's temporary directory exists: from step
    ``first`` on, wait for ``<k>.orbax-checkpoint-tmp``, freeze the process (SIGSTOP: nothing can
    rename it now), check the directory is still there and kill. Returns the step k killed."""
    proc = subprocess.Popen([sys.executable, WORKER, "loop", directory], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            if not line.startswith("SAVING") or int(line.split()[1]) < first:
                continue
            k = int(line.split()[1])
            tmp = os.path.join(directory, f"{k}.orbax-checkpoint-tmp")
            while not os.path.exists(tmp) and not os.path.exists(os.path.join(directory, str(k))):
                if time.monotonic() > deadline:
                    raise AssertionError("the saving loop stalled")
                time.sleep(0.0005)
            proc.send_signal(signal.SIGSTOP)
            if os.path.isdir(tmp) and not os.path.exists(os.path.join(directory, str(k))):
                proc.send_signal(signal.SIGKILL)
                return k
            proc.send_signal(signal.SIGCONT)  # the write finished first: catch the next one
        raise AssertionError("the saving loop ended before a kill landed mid-write")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Two saving loops, each killed in the middle of writing a step (at step >= 3, >= 5), so the
    step to restore is never the first one saved."""
    root = tmp_path_factory.mktemp("killed")
    runs = [(str(root / f"run{first}"), first) for first in (3, 5)]
    with ThreadPoolExecutor(len(runs)) as pool:  # side by side
        return list(zip([d for d, _ in runs], pool.map(lambda run: _kill_mid_write(*run), runs)))


def check_killed_saves(killed):
    reference = [make_state("fp32")]
    step = zj.make_train_step(loss_fn, reference[0], donate=False)
    data = batches(40)
    for directory, k in killed:
        # the kill landed mid-write: step k's temporary directory is left, step k is not there
        assert os.path.isdir(os.path.join(directory, f"{k}.orbax-checkpoint-tmp"))
        assert not os.path.exists(os.path.join(directory, str(k)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed, data_state = CheckpointManager(directory).restore(reference[0])
        text = " ".join(str(w.message) for w in caught)
        assert f"skipping incomplete checkpoint {os.path.join(directory, f'{k}.orbax-checkpoint-tmp')}" in text
        # the newest complete step: the one before (a save starts once the previous one is written)
        assert k >= 3 and int(resumed.step) == k - 1 and data_state == {"next_batch": k - 1}, (int(resumed.step), k)
        while len(reference) <= k - 1:
            reference.append(step(reference[-1], data[len(reference) - 1])[0])
        assert_same(reference[k - 1], resumed)
        resumed, _ = step(resumed, data[k - 1])  # training continues
        assert int(resumed.step) == k


def test_killed_saves_leave_a_restorable_checkpoint(killed):
    """SIGKILL a process in the middle of a save; the newest complete step restores."""
    check_killed_saves(killed)


def test_killed_save_check_catches_a_restore_of_an_older_step(killed, monkeypatch):
    monkeypatch.setattr(manager, "pick_step", lambda directory, step: steps._scan(directory)[0])
    with pytest.raises(AssertionError):
        check_killed_saves(killed)


# ------------------------------------------------------------------------------ bad input
def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        zj.checkpoint.restore(tmp_path / "nope", abstract())


def test_incomplete_step_is_skipped_with_a_warning(saved, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    (directory / "7").mkdir()  # a step directory without metadata
    (directory / "7" / "state").mkdir()
    (directory / "9.orbax-checkpoint-tmp-1234").mkdir()  # what a killed save leaves
    with pytest.warns(UserWarning) as caught:
        restored, _ = zj.checkpoint.restore(directory, abstract(4, stage=2, precision="bf16"))
    text = " ".join(str(w.message) for w in caught)
    assert str(directory / "7") in text and "9.orbax-checkpoint-tmp-1234" in text
    assert int(restored.step) == 2
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="step 7"):
        zj.checkpoint.restore(directory, abstract(4, stage=2), step=7)


def _other_model(change):
    p = init_params(jax.random.PRNGKey(0))
    if change == "missing":
        del p["odd"]
    elif change == "extra":
        p["head"] = jnp.zeros((3, 3))
    else:
        p["out"] = jnp.zeros((20, 6))
    return p


@pytest.mark.parametrize("change,needle", [("missing", "params/odd"), ("extra", "params/head"),
                                           ("reshaped", "params/out: checkpoint shape (20, 5)")])
def test_mismatched_target_lists_the_leaves(saved, change, needle):
    target = zj.abstract_train_state(_other_model(change), TX(), mesh=zj.make_mesh(2),
                                     config=zj.ZeroConfig(stage=1))
    with pytest.raises(ValueError, match="does not match the target") as info:
        zj.checkpoint.restore(saved[0], target)
    assert needle in str(info.value)
    assert "opt_state/0/mu/" in str(info.value)  # the optimizer leaves are named too


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_data_file_is_an_error(saved, tmp_path, damage):
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory / "2" / "state") for f in fs
             if os.sep + "d" + os.sep in os.path.join(r, f)]
    for name in files:  # Orbax may keep the data under the root and the per-process directory
        if damage == "truncate":
            with open(name, "r+b") as f:
                f.truncate(os.path.getsize(name) // 2)
        else:
            os.remove(name)
    with pytest.raises(CheckpointError, match=str(directory / "2")):
        zj.checkpoint.restore(directory, abstract(8, stage=3, precision="bf16", param_persistence_threshold=0))


def _flip_a_data_byte(directory):
    """Flip one bit in the middle of the largest data chunk that step 2's state reads (the
    OCDBT root's ``d/``; the per-process copies under ``ocdbt.process_*`` are merged into it)."""
    root = directory / "2" / "state" / "d"
    name = max((root / f for f in os.listdir(root)), key=os.path.getsize)
    data = bytearray(name.read_bytes())
    data[len(data) // 2] ^= 0x10
    name.write_bytes(bytes(data))


def check_corrupt_chunk_is_an_error(directory):
    with pytest.raises(CheckpointError, match=str(directory / "2")):
        zj.checkpoint.restore(directory, abstract(8, stage=3, precision="bf16", param_persistence_threshold=0))


def test_corrupt_data_chunk_is_an_error(saved, tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    _flip_a_data_byte(directory)
    check_corrupt_chunk_is_an_error(directory)


def test_corrupt_chunk_check_catches_a_restore_without_integrity_checks(saved, tmp_path, monkeypatch):
    """A restore that reads zeros where the storage fails and compares no checksum passes silently."""
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    _flip_a_data_byte(directory)
    real = manager.read_state

    def zeros_on_error(step_dir, item, restore_args, this_process_only=False):
        try:
            return real(step_dir, item, restore_args, this_process_only)
        except CheckpointError:
            return jax.tree_util.tree_map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), item)

    monkeypatch.setattr(manager, "read_state", zeros_on_error)
    monkeypatch.setattr(manager, "verify", lambda meta, sums, where: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        check_corrupt_chunk_is_an_error(directory)


# ------------------------------------------------------------------------ consolidation
def test_consolidate_safetensors_equals_full_params(saved, tmp_path):
    directory, state = saved
    out = consolidate(directory, tmp_path / "model.safetensors", progress=False)
    got = load_file(str(out))
    want = jax.device_get(state.full_params(jnp.float32))
    names = {"/".join(str(getattr(k, "key", k)) for k in path).replace("/", "."): x
             for path, x in jax.tree_util.tree_flatten_with_path(want)[0]}
    assert set(got) == set(names) and "dense.kernel" in got
    for name, x in names.items():
        np.testing.assert_array_equal(got[name], x)


def test_consolidate_cli_bf16_and_orbax(saved, tmp_path):
    directory, state = saved
    from zerojax._cli import main
    out = tmp_path / "m16.safetensors"
    assert main(["checkpoint", "consolidate", directory, str(out), "--dtype", "bfloat16", "--step", "2"]) == 0
    got = load_file(str(out))
    want = jax.device_get(state.full_params(jnp.bfloat16))
    np.testing.assert_array_equal(got["emb"], want["emb"])
    assert got["emb"].dtype == want["emb"].dtype
    consolidate(directory, tmp_path / "orbax", format="orbax", progress=False)
    import orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore(str(tmp_path / "orbax"))
    np.testing.assert_array_equal(np.asarray(tree["dense"]["kernel"]), jax.device_get(state.full_params())["dense"]["kernel"])


# ------------------------------------------------------------------ read without zerojax
PLAIN_ORBAX = textwrap.dedent("""
    import json, sys
    import jax, numpy as np, orbax.checkpoint as ocp

    step_dir, out = sys.argv[1], sys.argv[2]
    # every leaf read as a numpy array: no sharding, so any device count reads it
    ckptr = ocp.PyTreeCheckpointer()
    tree_meta = ckptr.metadata(f"{step_dir}/state").item_metadata.tree
    args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree_meta)
    tree = ckptr.restore(f"{step_dir}/state", args=ocp.args.PyTreeRestore(restore_args=args))
    # a split dimension is zero-padded on disk: slice each leaf to its logical shape
    meta = json.load(open(f"{step_dir}/zerojax/metadata"))
    arrays = {}
    for kind in ("params", "opt_state"):
        for path, info in meta[kind].items():
            x = tree[kind]
            for key in path.split("/"):
                x = x[key]
            arrays[f"{kind}/{path}"] = np.asarray(x)[tuple(slice(0, n) for n in info["shape"])]
    assert "zerojax" not in sys.modules and jax.device_count() == 1, (sorted(sys.modules), jax.device_count())
    np.savez(out, **arrays)
""")


def test_plain_orbax_reads_a_checkpoint_on_one_device_without_zerojax(saved, tmp_path):
    """The recipe of the checkpoint docstring, in a fresh process with one device and no zerojax."""
    directory, state = saved  # written split over 8 devices, dimensions padded
    script = tmp_path / "read.py"
    script.write_text(PLAIN_ORBAX)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "read.npz"
    proc = subprocess.run([sys.executable, str(script), os.path.join(directory, "2"), str(out)], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = dict(np.load(out))
    want = jax.device_get(state.full_params(jnp.float32))
    for path, x in jax.tree_util.tree_flatten_with_path(want)[0]:
        np.testing.assert_array_equal(got["params/" + path_str(path)], x)
    opt_paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]]
    for path, x in zip(opt_paths, logical_opt(state)):
        np.testing.assert_array_equal(got["opt_state/" + path], x)
    assert len(got) == len(jax.tree_util.tree_leaves(want)) + len(opt_paths)


# ------------------------------------------------------------------------------ manager
def test_best_and_max_to_keep_and_16bit_copy(tmp_path):
    state = make_state("fp32", n=2, precision="bf16", gather_16bit_weights_on_model_save=True)
    mngr = CheckpointManager(tmp_path / "ck", max_to_keep=2, best_metric="loss")
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0)):
        mngr.save(step, state, metrics={"loss": loss})
    mngr.wait_until_finished()
    assert mngr.best_step() == 2 and mngr.all_steps() == [2, 3] and mngr.latest_step() == 3
    copy = load_file(str(tmp_path / "ck" / "3" / "model_16bit.safetensors"))
    np.testing.assert_array_equal(copy["out"], jax.device_get(state.full_params(jnp.bfloat16))["out"])
    with pytest.raises(ValueError, match="metrics"):
        mngr.save(5, state)
    mngr.close()


def test_values_not_matching_checksums_are_an_error(saved, tmp_path):
    """Whatever the storage layer returns, values that differ from what was saved never pass silently."""
    directory = tmp_path / "ck"
    shutil.copytree(saved[0], directory)
    meta_path = directory / "2" / "zerojax" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["checksums"]["params/emb"] ^= 1
    del meta["checksum"]  # sealed again, so the metadata itself verifies and the array check must fire
    meta["checksum"] = digest(meta)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="params/emb"):
        zj.checkpoint.restore(directory, abstract(2, stage=1, precision="bf16"))
