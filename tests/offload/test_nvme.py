"""NvmeOptimizerStore: bitwise equal to in-memory HostAdamW, clear errors, safe failures."""
import errno
import os

import jax.numpy as jnp
import numpy as np
import pytest

from zerojax._errors import ConfigError
from zerojax.offload import _nvme as nvme
from zerojax.offload._host_adam import HostAdamW
from zerojax.offload._nvme import NvmeError, NvmeOptimizerStore

N, SUB = 1003, 128  # 8 sub-groups, the last one short
HP = dict(lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01)


def make_opt():
    return HostAdamW(**HP, num_threads=2, chunk_elements=32)


def data(steps, seed=0):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(N).astype(np.float32)
    grads = [(rng.standard_normal(N) * 0.1).astype(np.float32).astype(jnp.bfloat16)
             for _ in range(steps)]
    return p0, grads


def in_memory(p0, grads, scales):
    p, m, v = p0.copy(), np.zeros(N, np.float32), np.zeros(N, np.float32)
    out16 = np.empty(N, jnp.bfloat16)
    with make_opt() as opt:
        snapshots = []
        for k, (g, s) in enumerate(zip(grads, scales)):
            opt.step(p, g, m, v, count=k + 1, grad_scale=s, out16=out16)
            snapshots.append((p.copy(), m.copy(), v.copy(), out16.copy()))
    return snapshots


def assert_bitwise(store, expected):
    for name, want in zip(("master", "m", "v"), expected[:3]):
        np.testing.assert_array_equal(store.read(name).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("sub_group_size", [SUB, 1, N, 4096])
def test_bitwise_equal_to_host_adamw(tmp_path, sub_group_size):
    p0, grads = data(4)
    scales = [1.0, 0.5, 2.0, 0.25]
    expected = in_memory(p0, grads, scales)
    out16 = np.empty(N, jnp.bfloat16)
    with NvmeOptimizerStore(tmp_path, N, sub_group_size, optimizer=make_opt(),
                            drop_page_cache=True) as store:
        store.init(p0)
        np.testing.assert_array_equal(store.read_master(), p0)
        for k, (g, s) in enumerate(zip(grads, scales)):
            store.step(g, count=k + 1, grad_scale=s, out16=out16)
            assert_bitwise(store, expected[k])
            np.testing.assert_array_equal(out16.view(np.uint16), expected[k][3].view(np.uint16))
        assert store.committed_count == 4


def test_reopen_resumes_committed_state_with_another_sub_group_size(tmp_path):
    p0, grads = data(3, seed=1)
    expected = in_memory(p0, grads, [1.0] * 3)
    with NvmeOptimizerStore(tmp_path, N, SUB, optimizer=make_opt(), fsync=False) as store:
        store.init(p0)
        store.step(grads[0], count=1)
        store.step(grads[1], count=2)
    with NvmeOptimizerStore(tmp_path, N, 300, optimizer=make_opt()) as store:
        assert store.committed_count == 2
        assert_bitwise(store, expected[1])
        store.step(grads[2], count=3)
        assert_bitwise(store, expected[2])
    with pytest.raises(NvmeError, match="holds a state of 1003 elements"):
        NvmeOptimizerStore(tmp_path, N + 1, SUB)


def test_disk_full_mid_step_keeps_last_committed_state(tmp_path, monkeypatch):
    p0, grads = data(3, seed=2)
    expected = in_memory(p0, grads, [1.0] * 3)
    store = NvmeOptimizerStore(tmp_path, N, SUB, optimizer=make_opt())
    store.init(p0)
    store.step(grads[0], count=1)
    store.step(grads[1], count=2)

    real_write, calls = nvme._pwrite_all, [0]

    def flaky_write(fd, buf, offset):
        calls[0] += 1
        if calls[0] == 7:  # fails part-way: some sub-groups of step 3 are already written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(fd, buf, offset)

    monkeypatch.setattr(nvme, "_pwrite_all", flaky_write)
    with pytest.raises(NvmeError) as info:
        store.step(grads[2], count=3)
    err = info.value
    assert err.errno == errno.ENOSPC and isinstance(err, OSError)
    assert str(tmp_path) in str(err) and "free space" in str(err)
    assert "last committed step is intact" in str(err)
    assert store.committed_count == 2
    assert_bitwise(store, expected[1])
    # A fresh process sees the same committed state.
    with NvmeOptimizerStore(tmp_path, N, SUB, optimizer=make_opt()) as other:
        assert other.committed_count == 2
        assert_bitwise(other, expected[1])
    # Space freed: the step is retried and lands exactly where it would have.
    monkeypatch.setattr(nvme, "_pwrite_all", real_write)
    store.step(grads[2], count=3)
    assert_bitwise(store, expected[2])
    store.close()


def test_read_failure_is_reported_as_nvme_error(tmp_path, monkeypatch):
    p0, grads = data(1)
    with NvmeOptimizerStore(tmp_path, N, SUB, optimizer=make_opt()) as store:
        store.init(p0)

        def broken_read(fd, buf, offset):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(nvme, "_pread_into", broken_read)
        with pytest.raises(NvmeError, match="reading optimizer state failed") as info:
            store.step(grads[0], count=1)
        assert info.value.errno == errno.EIO
        monkeypatch.undo()
        np.testing.assert_array_equal(store.read_master(), p0)


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(NvmeError, match="does not exist.*mkdir -p") as info:
        NvmeOptimizerStore(missing, N, SUB)
    assert info.value.errno == errno.ENOENT and str(missing) in str(info.value)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NvmeError, match="not a directory") as info:
        NvmeOptimizerStore(f, N, SUB)
    assert info.value.errno == errno.ENOTDIR


def test_path_not_writable(tmp_path):
    if os.geteuid() == 0:
        path = "/sys"  # refuses new files even to root
        if not os.path.isdir(path):
            pytest.skip("needs a directory root cannot write to")
    else:
        path = tmp_path / "ro"
        path.mkdir()
        path.chmod(0o500)
    with pytest.raises(NvmeError, match="cannot be created here.*write permission"):
        NvmeOptimizerStore(path, N, SUB)


def test_not_enough_space(tmp_path, monkeypatch):
    class Tiny:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(nvme.os, "statvfs", lambda p: Tiny())
    with pytest.raises(NvmeError, match="GiB more free space") as info:
        NvmeOptimizerStore(tmp_path, 10**6, 1000)
    assert info.value.errno == errno.ENOSPC


def test_step_before_init_and_bad_sizes(tmp_path):
    with NvmeOptimizerStore(tmp_path, N, SUB, optimizer=make_opt()) as store:
        with pytest.raises(ConfigError, match="call init"):
            store.step(np.zeros(N, np.float32), count=1)
        with pytest.raises(ValueError, match="expected a flat array of 1003"):
            store.init(np.zeros(N - 1, np.float32))
