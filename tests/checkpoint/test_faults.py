"""Faults around checkpoints: a full disk during a save, damaged JSON files, an intact-step
restore, failures named by zerojax's own errors, and one compile per state layout."""
import contextlib
import errno
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest
from etils import epath

import zerojax as zj
from tests._ckpt_worker import make_state
from tests.helpers import count_compiles
from zerojax.checkpoint import CheckpointError, CheckpointManager
from zerojax.checkpoint import _format as ckpt_format
from zerojax.checkpoint import _integrity as integrity

META = os.path.join("zerojax", "metadata")
DATA = os.path.join("data_state", "metadata")


def params_of(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state.full_params()))]


def partials(directory):
    return [n for n in os.listdir(directory) if "orbax-checkpoint-tmp" in n]


@pytest.fixture(scope="module")
def state():
    return make_state("fp32", n=2)


# ------------------------------------------------------------------------------ disk full
class InjectedDiskFull:
    """ENOSPC from the lowest Python-level write of a checkpoint (etils' Path.write_text, which
    Orbax's JSON items go through), once armed, for files inside a save's temporary directory."""

    def __init__(self, monkeypatch):
        self.armed = False
        cls = type(epath.Path("/"))
        real = cls.write_text

        def write_text(path, *args, **kwargs):
            if self.armed and "orbax-checkpoint-tmp" in str(path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(cls, "write_text", write_text)

    def fill(self):
        self.armed = True

    def free(self):
        self.armed = False


class TmpfsDiskFull:
    """A real size-limited filesystem (tmpfs, needs root); ``fill`` leaves it with 32 KiB free."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", self.root], capture_output=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); the injected case runs instead")
        self.filler = os.path.join(self.root, "filler")

    def fill(self):
        with contextlib.suppress(OSError), open(self.filler, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        os.truncate(self.filler, os.path.getsize(self.filler) - 32768)

    def free(self):
        os.remove(self.filler)

    def close(self):
        subprocess.run(["umount", "-l", self.root], check=False)


@pytest.fixture(params=["injected", "injected-sync", "tmpfs"])
def disk(request, tmp_path, monkeypatch):
    if request.param == "tmpfs":
        fs = TmpfsDiskFull(tmp_path / "mnt")
        yield fs, os.path.join(fs.root, "ck"), True
        fs.close()
    else:
        yield InjectedDiskFull(monkeypatch), str(tmp_path / "ck"), request.param == "injected"


def test_disk_full_during_a_save(disk, state):
    fs, directory, async_save = disk
    before = params_of(state)
    mngr = CheckpointManager(directory, max_to_keep=1, async_save=async_save)
    mngr.save(1, state, data_state={"batch": 1})
    mngr.wait_until_finished()
    fs.fill()
    with pytest.raises(CheckpointError) as info:
        mngr.save(2, state, data_state={"batch": 2})
        mngr.wait_until_finished()  # an asynchronous write fails here
    text = str(info.value)
    assert "ENOSPC" in text and os.path.join(directory, "2") in text, text
    # the manager's truth is the disk: step 1 is still there, listed, and no partial directory is left
    assert mngr.latest_step() == 1 and mngr.all_steps() == [1]
    assert partials(directory) == [] and not os.path.exists(os.path.join(directory, "2"))
    for x, y in zip(params_of(state), before):  # the state in memory is untouched and trains on
        np.testing.assert_array_equal(x, y)
    fs.free()
    mngr.save(3, state, data_state={"batch": 3})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [3] and partials(directory) == []  # max_to_keep=1 still removes step 1
    restored, data_state = mngr.restore(state)
    assert data_state == {"batch": 3} and int(restored.step) == int(state.step)
    mngr.close()


def test_a_failed_save_check_catches_a_manager_that_trusts_orbax_list(tmp_path, state, monkeypatch):
    """The negative control: listing Orbax's in-memory steps (what the manager did) loses step 1."""
    fs = InjectedDiskFull(monkeypatch)
    mngr = CheckpointManager(tmp_path / "ck", max_to_keep=1)
    monkeypatch.setattr(CheckpointManager, "_failed", lambda self, step, e: CheckpointError(str(e)))
    monkeypatch.setattr(CheckpointManager, "all_steps", lambda self: list(self._mngr.all_steps()))
    mngr.save(1, state)
    mngr.wait_until_finished()
    fs.fill()
    with pytest.raises(CheckpointError):
        mngr.save(2, state)
        mngr.wait_until_finished()
    assert mngr.all_steps() != [1]


def test_partial_directories_go_at_the_next_save_and_by_cleanup(tmp_path, state):
    directory = tmp_path / "ck"
    mngr = CheckpointManager(directory)
    mngr.save(1, state)
    mngr.wait_until_finished()
    (directory / "5.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)  # a killed save's leftovers
    assert mngr.cleanup() == [str(directory / "5.orbax-checkpoint-tmp-1234")] and partials(directory) == []
    (directory / "6.orbax-checkpoint-tmp-99").mkdir()
    mngr.save(2, state)
    mngr.wait_until_finished()
    assert partials(directory) == []
    mngr.close()
    assert mngr.all_steps() == [1, 2]


# ------------------------------------------------------------------------ damaged files
@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, state):
    directory = tmp_path_factory.mktemp("two")
    with CheckpointManager(directory) as mngr:
        mngr.save(1, state, data_state={"batch": 1})
        mngr.save(2, state, data_state={"batch": 3})
    return directory


def _damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "flip-first-byte":
        data[0] ^= 0x80
    elif how == "flip-digit":  # one bit: "3" (0x33) -> "7" (0x37), still valid JSON
        i = data.index(b'"batch": 3') + len(b'"batch": ')
        data[i] ^= 0x04
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("name,how", [(META, "truncate"), (META, "flip-first-byte"), (DATA, "truncate"),
                                      (DATA, "flip-first-byte"), (DATA, "flip-digit")])
def test_damaged_json_is_an_error_naming_the_file_and_the_intact_steps(two_steps, tmp_path, state, name, how):
    directory = tmp_path / "ck"
    shutil.copytree(two_steps, directory)
    damaged = directory / "2" / name
    _damage(damaged, how)
    with pytest.raises(CheckpointError) as info:
        zj.checkpoint.restore(directory, state)
    assert str(damaged) in str(info.value) and "damaged" in str(info.value)
    assert "Intact steps (metadata and data state verified): [1]" in str(info.value)
    with pytest.warns(zj.ZeroJaxWarning, match="skipped damaged steps"):
        restored, data_state = CheckpointManager(directory).restore(state, step="latest_intact")
    assert data_state == {"batch": 1}
    for x, y in zip(params_of(restored), params_of(state)):
        np.testing.assert_array_equal(x, y)


def test_flipped_digit_check_catches_a_restore_without_the_data_checksum(two_steps, tmp_path, state, monkeypatch):
    """Without the data state's checksum the flipped digit restores {"batch": 7}."""
    directory = tmp_path / "ck"
    shutil.copytree(two_steps, directory)
    _damage(directory / "2" / DATA, "flip-digit")
    monkeypatch.setattr(integrity, "verify_data", lambda meta, data, path: data)
    monkeypatch.setattr(zj.checkpoint._steps, "verify_data", lambda meta, data, path: data)
    assert zj.checkpoint.restore(directory, state)[1] == {"batch": 7}


def test_latest_intact_skips_a_step_with_damaged_arrays(two_steps, tmp_path, state):
    directory = tmp_path / "ck"
    shutil.copytree(two_steps, directory)
    root = directory / "2" / "state" / "d"
    name = max((root / f for f in os.listdir(root)), key=os.path.getsize)
    data = bytearray(name.read_bytes())
    data[len(data) // 2] ^= 0x10
    name.write_bytes(bytes(data))
    with pytest.warns(zj.ZeroJaxWarning, match="step 2"):
        _, data_state = zj.checkpoint.restore(directory, state, step="latest_intact")
    assert data_state == {"batch": 1}
    assert zj.checkpoint.intact_steps(directory) == [1, 2]  # its JSON files are fine


# ----------------------------------------------------------- every failure a zerojax error
@pytest.mark.parametrize("case", ["missing-dir", "empty-dir", "missing-step", "bad-step", "no-target",
                                  "missing-meta", "missing-data", "json-array-meta", "data-not-json",
                                  "data-not-dict", "dir-is-a-file", "step-exists", "bad-best-mode", "bad-max-to-keep", "missing-metric",
                                  "mismatched-tree"])
def test_every_failure_is_a_zerojax_error(case, two_steps, tmp_path, state):
    directory = tmp_path / "ck"
    shutil.copytree(two_steps, directory)
    import optax
    calls = {
        "missing-dir": lambda: zj.checkpoint.restore(tmp_path / "nope", state),
        "empty-dir": lambda: zj.checkpoint.restore(tmp_path, state),
        "missing-step": lambda: zj.checkpoint.restore(directory, state, step=9),
        "bad-step": lambda: zj.checkpoint.restore(directory, state, step="newest"),
        "no-target": lambda: zj.checkpoint.restore(directory, None),
        "missing-meta": lambda: (os.remove(directory / "2" / META), zj.checkpoint.restore(directory, state, step=2)),
        "missing-data": lambda: (os.remove(directory / "2" / DATA), zj.checkpoint.restore(directory, state, step=2)),
        "json-array-meta": lambda: ((directory / "2" / META).write_text("[1, 2]"),
                                    zj.checkpoint.restore(directory, state)),
        "data-not-json": lambda: CheckpointManager(tmp_path / "w").save(1, state, data_state={"rng": object()}),
        "data-not-dict": lambda: CheckpointManager(tmp_path / "w").save(1, state, data_state=[1, 2]),
        "step-exists": lambda: CheckpointManager(directory).save(2, state),
        "dir-is-a-file": lambda: ((tmp_path / "f").write_text("x"), CheckpointManager(tmp_path / "f")),
        "bad-best-mode": lambda: CheckpointManager(tmp_path / "w", best_mode="lowest"),
        "bad-max-to-keep": lambda: CheckpointManager(tmp_path / "w", max_to_keep=0),
        "missing-metric": lambda: CheckpointManager(tmp_path / "w", best_metric="loss").save(1, state),
        "mismatched-tree": lambda: zj.checkpoint.restore(directory, zj.abstract_train_state(
            {"w": jax.ShapeDtypeStruct((3, 3), np.float32)}, optax.sgd(0.1), mesh=zj.make_mesh(2))),
    }
    with pytest.raises(zj.ZeroJaxError) as info:
        calls[case]()
    assert type(info.value).__module__ == "zerojax._errors"


# ------------------------------------------------------------------ one compile per layout


def test_save_and_restore_compile_once_per_layout(tmp_path):
    state = make_state("fp32", n=4, precision="bf16")  # a layout no other test in this file uses
    mngr = CheckpointManager(tmp_path / "ck")
    per_save = []
    for k in range(3):
        with count_compiles() as seen:
            mngr.save(k + 1, state)
            mngr.wait_until_finished()
        per_save.append(list(seen))
    full = state.full_params()
    per_restore = []
    for k in range(3):  # a fresh target each time, as a training script builds one
        target = zj.abstract_train_state(full, state.tx, mesh=state.plan.mesh, config=state.plan.config)
        with count_compiles() as seen:
            jax.block_until_ready(mngr.restore(target, step=k + 1)[0])
        per_restore.append(list(seen))
    mngr.close()
    # the first save and restore may find their programs compiled by another test of the same layout;
    # that the counter sees compiles at all is the negative control's (below)
    assert per_save[1:] == [[], []] and per_restore[1:] == [[], []], (per_save, per_restore)


def test_compile_count_catches_a_fresh_program_per_save(tmp_path, monkeypatch):
    """The negative control: with the program cache off every save compiles again."""
    monkeypatch.setattr(ckpt_format, "cached_program", lambda key, make: make())
    state = make_state("fp32", n=2, stage=1)
    mngr = CheckpointManager(tmp_path / "ck")
    mngr.save(1, state)
    with count_compiles() as seen:
        mngr.save(2, state)
        mngr.wait_until_finished()
    mngr.close()
    assert seen


def test_layout_key_is_equal_for_equal_layouts_from_a_deepspeed_config():
    """A config read from DeepSpeed JSON holds dicts (optimizer block): equal layouts still share programs."""
    import optax

    def target():
        config = zj.ZeroConfig.from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 2},
                                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=8)
        return zj.abstract_train_state({"w": jax.ShapeDtypeStruct((8, 4), np.float32)}, optax.adam(1e-3),
                                       mesh=zj.make_mesh(8), config=config)

    a, b = target(), target()
    assert ckpt_format.layout_key(a.plan, a.opt_state) == ckpt_format.layout_key(b.plan, b.opt_state)
    other = zj.abstract_train_state({"w": jax.ShapeDtypeStruct((8, 5), np.float32)}, optax.adam(1e-3),
                                    mesh=zj.make_mesh(8), config=a.plan.config)
    assert ckpt_format.layout_key(a.plan, a.opt_state) != ckpt_format.layout_key(other.plan, other.opt_state)
