"""Optimizer state on NVMe: AdamW over files, one sub-group at a time, I/O overlapped.

ZeRO-Infinity keeps the fp32 master weights and both Adam moments on disk and streams
them through host memory in sub-groups of ``sub_group_size`` elements. Here a bounded
three-stage pipeline runs per step: a reader thread fetches sub-group i+1 while the
calling thread updates sub-group i with ``HostAdamW`` and a writer thread writes
sub-group i-1 back. Host memory holds three sub-group buffers, never the whole state::

    store = NvmeOptimizerStore("/nvme/run1", n, sub_group_size=1 << 24,
                               optimizer=HostAdamW(lr=1e-4, weight_decay=0.1))
    store.init(master_fp32)
    store.step(grads_bf16, count=1, grad_scale=1 / loss_scale, out16=params_bf16)
    master = store.read_master()
    store.close()

The update is elementwise, so the result is bitwise what ``HostAdamW`` computes on the
same buffers in memory.

Crash and disk-full safety (ping-pong slots plus a committed marker): the state is kept
in two slot files, ``slot0.bin`` and ``slot1.bin``. A step reads the slot named by the
``COMMITTED`` marker and writes every sub-group to the other slot; only when all writes
have finished (and, with ``fsync=True``, reached the disk) is the marker replaced
atomically (write, fsync, rename) to name the new slot. A failure mid-step (ENOSPC, EIO,
a crash) therefore leaves the marker on the last complete step: the store can be reopened
or the step retried. The price is twice the state's size on disk; both slots are
preallocated at ``init`` so a full disk is usually reported before training starts. What
a failed step had already written to ``out16`` must be discarded by the caller.

Layout of a slot: master, m and v (fp32) one after the other, each ``num_elements``
long, so the layout does not depend on ``sub_group_size`` (a store may be reopened with
another) and a step streams through three sequential regions. With ``params_dtype`` (the
16-bit params of ZeRO-Infinity, ``offload_param="nvme"``) a fourth region follows: the params
in that dtype, written by the step beside the state they were computed from, so the committed
marker names params and optimizer state of the same step; :meth:`read_params` reads them.
"""
from __future__ import annotations

import errno as _errno
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from zerojax._errors import ConfigError, NvmeError
from zerojax.offload._flat import LeafSource
from zerojax.offload._host_adam import HostAdamW

__all__ = ["NvmeError", "NvmeOptimizerStore"]

_MARKER = "COMMITTED"
DIRTY_BYTES = 256 << 20  # written bytes a store leaves in the page cache before it syncs them
_FIELDS = ("master", "m", "v")


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Writes all of ``buf`` at ``offset`` (os.pwrite may write less than asked)."""
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fills ``buf`` from ``offset`` without an intermediate bytes object."""
    while len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf], offset)
        else:  # platforms without preadv: one extra copy
            data = os.pread(fd, len(buf), offset)
            n = len(data)
            buf[:n] = data
        if n == 0:
            raise OSError(_errno.EIO, "unexpected end of file")
        buf, offset = buf[n:], offset + n


def _reserve(fd: int, nbytes: int) -> None:
    """Allocates the file's blocks up front where the file system can."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except (OSError, AttributeError) as e:
        if isinstance(e, OSError) and e.errno in (_errno.ENOSPC, _errno.EDQUOT):
            raise
        os.ftruncate(fd, nbytes)  # no fallocate here: blocks are allocated on write


def _validate_dir(path: str) -> None:
    if not os.path.exists(path):
        raise NvmeError(path, "the directory does not exist", f"create it (mkdir -p {path}) "
                        "on the NVMe drive, or point nvme_path at an existing one",
                        _errno.ENOENT)
    if not os.path.isdir(path):
        raise NvmeError(path, "this is not a directory", "point nvme_path at a directory "
                        "on the NVMe drive; the store creates its files inside it",
                        _errno.ENOTDIR)
    probe = os.path.join(path, f".zerojax-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise NvmeError(path, f"files cannot be created here ({e.strerror})",
                        "give this process write permission on the directory or choose "
                        "a writable one", e.errno or _errno.EACCES) from e


def _validate_space(path: str, need_bytes: int, per_element: int = 12) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise NvmeError(path, f"needs {need_bytes / 2**30:.2f} GiB more free space (two "
                        f"slots of {per_element} bytes per element) but has {free / 2**30:.2f} GiB",
                        "free space, use a larger drive or offload fewer parameters",
                        _errno.ENOSPC)


def _regions(buf: np.ndarray, n: int, params_dtype) -> dict:
    """The named regions of a slot's bytes: master, m, v (fp32) and params (``params_dtype``)."""
    out = {name: buf[4 * r * n:4 * (r + 1) * n].view(np.float32) for r, name in enumerate(_FIELDS)}
    if params_dtype is not None:
        out["params"] = buf[12 * n:12 * n + np.dtype(params_dtype).itemsize * n].view(params_dtype)
    return out


def read_marker(path: str) -> Optional[dict]:
    """The committed marker of the store in ``path`` (None where nothing is committed there)."""
    try:
        with open(os.path.join(path, _MARKER)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise NvmeError(path, f"the {_MARKER} marker cannot be read ({e})",
                        "restore it from a backup or delete the directory's contents to start afresh") from e


def committed_regions(path: str, marker: dict) -> dict:
    """Read-only memory maps of the committed slot's regions (``master``, ``m``, ``v`` and, in a
    store with params, ``params``): nothing is read until used, so a state larger than memory
    can be streamed from them. A store step rewrites the other slot only; the one after it
    rewrites this one."""
    n = int(marker["num_elements"])
    pdt = None if marker.get("params_dtype") is None else np.dtype(marker["params_dtype"])
    size = (12 + (0 if pdt is None else pdt.itemsize)) * n
    mm = np.memmap(os.path.join(path, f"slot{marker['slot']}.bin"), np.uint8, "r", shape=(size,))
    # read once, front to back: the kernel may reclaim each page as soon as it has been read,
    # ahead of other memory, so streaming a state larger than the job's memory stays within it
    advise = getattr(getattr(mm, "_mmap", None), "madvise", None)
    if advise is not None and hasattr(mmap, "MADV_SEQUENTIAL"):
        advise(mmap.MADV_SEQUENTIAL)
    return _regions(mm, n, pdt)


class NvmeOptimizerStore:
    """fp32 master weights and Adam moments in files, updated sub-group by sub-group.

    Args:
      path: an existing, writable directory (checked here, before any step).
      num_elements: size of the flat state.
      sub_group_size: elements per sub-group; host memory use is about
        ``3 buffers * 12 bytes * sub_group_size``.
      optimizer: the ``HostAdamW`` doing the math (default: ``HostAdamW()``); closed
        with the store only if the store created it.
      fsync: make each step durable before committing it (off: faster, still
        consistent after a process crash, not after a power loss).
      drop_page_cache: advise the kernel to drop the file pages after use, so the
        state does not crowd the page cache.
      params_dtype: keep the params in this (16-bit) dtype in the slots too: ``init`` writes
        them, each ``step`` writes the updated ones (instead of into ``out16``) and
        :meth:`read_params` reads the committed ones.

    An existing committed state of the same size under ``path`` is resumed.
    """

    def __init__(self, path: str, num_elements: int, sub_group_size: int, *,
                 optimizer: Optional[HostAdamW] = None, fsync: bool = True,
                 drop_page_cache: bool = False, params_dtype=None):
        if num_elements < 1 or sub_group_size < 1:
            raise ConfigError(f"NvmeOptimizerStore: num_elements={num_elements} and "
                             f"sub_group_size={sub_group_size} must both be >= 1.")
        self.path = os.fspath(path)
        self.num_elements, self.sub_group_size = int(num_elements), int(sub_group_size)
        self.params_dtype = None if params_dtype is None else np.dtype(params_dtype)
        self._params_name = None if params_dtype is None else self.params_dtype.name  # as the marker says it
        self.per_element = 12 + (0 if self.params_dtype is None else self.params_dtype.itemsize)
        self.slot_bytes = self.per_element * self.num_elements
        self._marker = os.path.join(self.path, _MARKER)
        _validate_dir(self.path)
        resume = self._read_marker_if_present()
        have = sum(os.path.getsize(self._slot_file(k)) for k in (0, 1)
                   if os.path.exists(self._slot_file(k)))
        _validate_space(self.path, max(0, 2 * self.slot_bytes - have), self.per_element)
        self._owns_optimizer = optimizer is None
        self.optimizer = optimizer if optimizer is not None else HostAdamW()
        self.fsync, self.drop_page_cache = bool(fsync), bool(drop_page_cache)
        self._drop = self.drop_page_cache and hasattr(os, "posix_fadvise")
        self._dirty = 0  # bytes written since the last sync (_written)
        self._fds = [os.open(self._slot_file(k), os.O_RDWR | os.O_CREAT, 0o600) for k in (0, 1)]
        self._slot = None if resume is None else resume["slot"]
        self.committed_count = None if resume is None else resume["count"]
        self.marker = resume  # the committed marker (None: nothing committed)
        # Three (3, sub_group) buffers: read-ahead, update, write-behind.
        rows = min(self.sub_group_size, self.num_elements)
        self._bufs = [np.empty((3, rows), np.float32) for _ in range(3)]
        self._bufs16 = [None if self.params_dtype is None else np.empty(rows, self.params_dtype) for _ in range(3)]
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")

    # -- public ------------------------------------------------------------------------
    def init(self, params_flat, extra: Optional[dict] = None) -> None:
        """Starts from ``params_flat`` (cast to fp32) with zero moments; commits count 0
        (``extra``: more fields for the marker, see :meth:`step`). ``params_flat`` is a flat
        array, or a :meth:`FlatLayout.source` of the params' leaves, read a sub-group at a time
        (so the whole state never has to be in memory at once)."""
        if not isinstance(params_flat, LeafSource):
            params_flat = np.asarray(params_flat).reshape(-1)
        self._check_size(params_flat, "params_flat")
        dst = 0 if self._slot is None else 1 - self._slot
        for fd in self._fds:  # reserve the space now so a full disk shows up here
            try:
                _reserve(fd, self.slot_bytes)
            except OSError as e:
                raise self._io_error(e, "reserving space for") from e
        writes: list = []
        try:
            for i in range(self.num_groups):
                a, b = self._bounds(i)
                buf = self._bufs[i % 3]
                if i >= 3:
                    writes[i - 3].result()
                np.copyto(buf[0, :b - a], params_flat[a:b], casting="same_kind")
                buf[1:, :b - a] = 0
                buf16 = self._bufs16[i % 3]
                if buf16 is not None:
                    buf16[:b - a] = buf[0, :b - a]
                writes.append(self._writer.submit(self._write_group, dst, i, buf, buf16))
            self._wait(writes)
            if self.fsync:
                os.fsync(self._fds[dst])
        except BaseException as e:
            self._drain(writes)
            if isinstance(e, OSError) and not isinstance(e, NvmeError):  # from os.fsync
                raise self._io_error(e, "syncing") from e
            raise
        self._commit(dst, 0, extra)

    def step(self, grads_flat: np.ndarray, count: int, lr: Optional[float] = None,
             grad_scale: float = 1.0, out16: Optional[np.ndarray] = None, extra: Optional[dict] = None) -> None:
        """One AdamW step over the whole state (see ``HostAdamW.step`` for the args). ``extra``:
        JSON fields the commit's marker carries beside the slot and count (the train step
        records the TrainState step and the optimizer's settings there, so a checkpoint can be
        written from the files alone and a stale state is told from the committed one)."""
        if self._slot is None:
            raise ConfigError(f"NvmeOptimizerStore({self.path!r}): call init(params) before "
                               "step(); there is no committed state yet.")
        self._check_size(grads_flat, "grads_flat")
        if out16 is not None:
            if self.params_dtype is not None:
                raise ConfigError("NvmeOptimizerStore.step: this store keeps the params itself "
                                  "(params_dtype); leave out16 out and read them with read_params().")
            self._check_size(out16, "out16")
        src, dst, g = self._slot, 1 - self._slot, self.num_groups
        reads: list = [self._reader.submit(self._read_group, src, 0, self._bufs[0])]
        writes: list = []
        try:
            for i in range(g):
                buf = self._bufs[i % 3]
                reads[i].result()
                if i + 1 < g:
                    if i >= 2:  # buffer (i+1) % 3 last held sub-group i-2
                        writes[i - 2].result()
                    reads.append(self._reader.submit(self._read_group, src, i + 1,
                                                     self._bufs[(i + 1) % 3]))
                a, b = self._bounds(i)
                k = b - a
                buf16 = self._bufs16[i % 3]
                # an optimizer whose rule differs by element (Muon's two groups) is told where it is
                where = {"offset": a} if getattr(self.optimizer, "takes_offset", False) else {}
                self.optimizer.step(buf[0, :k], grads_flat[a:b], buf[1, :k], buf[2, :k],
                                    count, lr=lr, grad_scale=grad_scale,
                                    out16=buf16[:k] if buf16 is not None else None if out16 is None else out16[a:b],
                                    **where)
                writes.append(self._writer.submit(self._write_group, dst, i, buf, buf16))
            self._wait(writes)
            if self.fsync:
                os.fsync(self._fds[dst])
        except BaseException as e:
            self._drain(reads + writes)  # no thread may touch the buffers after we return
            if isinstance(e, OSError) and not isinstance(e, NvmeError):  # from os.fsync
                raise self._io_error(e, "syncing") from e
            raise
        self._commit(dst, int(count), extra)

    def annotate(self, extra: dict) -> None:
        """Rewrites the marker's extra fields over the same committed slot and count (a
        skipped step moves the TrainState step without an update)."""
        if self._slot is None:
            raise ConfigError(f"NvmeOptimizerStore({self.path!r}): nothing committed yet; call init(params) first.")
        self._commit(self._slot, int(self.committed_count), extra)

    def reload(self) -> Optional[dict]:
        """Reads the marker again (another store object, a restore, may have committed since);
        returns it (None: nothing committed)."""
        marker = self._read_marker_if_present()
        if marker is not None:
            self._slot, self.committed_count, self.marker = marker["slot"], marker["count"], marker
        return marker

    def load(self, write, count: int, extra: Optional[dict] = None) -> None:
        """Replaces the committed state: ``write(regions)`` fills the free slot through writable
        memory maps of its regions (``committed_regions``' names), which is then synced and
        committed as ``count``. A failure before the commit leaves the committed state as it was."""
        dst = 0 if self._slot is None else 1 - self._slot
        try:
            _reserve(self._fds[dst], self.slot_bytes)
            mm = np.memmap(self._slot_file(dst), np.uint8, "r+", shape=(self.slot_bytes,))
            try:
                write(_regions(mm, self.num_elements, self.params_dtype))
                mm.flush()
            finally:
                del mm
            if self.fsync:
                os.fsync(self._fds[dst])
        except OSError as e:
            raise self._io_error(e, "writing") from e
        self._commit(dst, int(count), extra)

    def read(self, name: str = "master", out: Optional[np.ndarray] = None) -> np.ndarray:
        """The committed ``master``, ``m`` or ``v`` as one flat fp32 array."""
        if name not in _FIELDS:
            raise ConfigError(f"NvmeOptimizerStore.read: name={name!r}; expected one of {_FIELDS}.")
        if self._slot is None:
            raise ConfigError(f"NvmeOptimizerStore({self.path!r}): nothing committed yet; "
                               "call init(params) first.")
        out = np.empty(self.num_elements, np.float32) if out is None else out
        row = _FIELDS.index(name)
        for i in range(self.num_groups):
            a, b = self._bounds(i)
            try:
                _pread_into(self._fds[self._slot], memoryview(out[a:b]).cast("B"),
                            4 * (row * self.num_elements + a))
            except OSError as e:
                raise self._io_error(e, "reading") from e
        return out

    def read_master(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        return self.read("master", out)

    def read_params(self, start: int, out: np.ndarray) -> np.ndarray:
        """The committed params ``[start, start + out.size)`` into ``out``: the ``params_dtype``
        region, or the fp32 master where the store has none. Safe beside a running step, which
        writes only the other slot; a failing read raises :class:`NvmeError`."""
        if self._slot is None:
            raise ConfigError(f"NvmeOptimizerStore({self.path!r}): nothing committed yet; "
                              "call init(params) first.")
        want = np.float32 if self.params_dtype is None else self.params_dtype
        if out.dtype != want or start < 0 or start + out.size > self.num_elements:
            raise ConfigError(f"NvmeOptimizerStore.read_params: [{start}, {start + out.size}) of "
                              f"{np.dtype(out.dtype).name} is outside the {self.num_elements} params "
                              f"of {np.dtype(want).name} the store holds.")
        base = 0 if self.params_dtype is None else 12 * self.num_elements
        try:
            _pread_into(self._fds[self._slot], memoryview(out.reshape(-1).view(np.uint8)),
                        base + out.itemsize * start)
        except OSError as e:
            raise self._io_error(e, "reading", "the params") from e
        return out

    @property
    def num_groups(self) -> int:
        return -(-self.num_elements // self.sub_group_size)

    def close(self) -> None:
        """Stops the I/O threads and closes the files (the committed state stays)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._owns_optimizer:
            self.optimizer.close()

    def __enter__(self) -> "NvmeOptimizerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _slot_file(self, k: int) -> str:
        return os.path.join(self.path, f"slot{k}.bin")

    def _bounds(self, i: int):
        a = i * self.sub_group_size
        return a, min(a + self.sub_group_size, self.num_elements)

    def _check_size(self, x, name: str) -> None:
        if np.ndim(x) != 1 or np.size(x) != self.num_elements:
            raise ConfigError(f"NvmeOptimizerStore: {name} has shape {np.shape(x)}; expected "
                             f"a flat array of {self.num_elements} elements.")

    def _group_view(self, i: int, buf: np.ndarray, buf16=None):
        """(bytes of buffer row r, file offset) for master, m and v of sub-group i (and the
        params, where ``buf16`` holds them)."""
        a, b = self._bounds(i)
        n = self.num_elements
        views = [(memoryview(buf[r, :b - a]).cast("B"), 4 * (r * n + a)) for r in range(3)]
        if buf16 is not None:
            views.append((memoryview(buf16[:b - a].view(np.uint8)), 12 * n + buf16.itemsize * a))
        return views

    def _read_group(self, slot: int, i: int, buf: np.ndarray) -> None:
        self._transfer(slot, i, buf, _pread_into, "reading")

    def _write_group(self, slot: int, i: int, buf: np.ndarray, buf16=None) -> None:
        self._transfer(slot, i, buf, _pwrite_all, "writing", buf16)

    def _transfer(self, slot: int, i: int, buf: np.ndarray, io, doing: str, buf16=None) -> None:
        fd = self._fds[slot]
        try:
            for mv, off in self._group_view(i, buf, buf16):
                io(fd, mv, off)
                if self._drop:
                    os.posix_fadvise(fd, off, len(mv), os.POSIX_FADV_DONTNEED)
                if io is _pwrite_all:
                    self._written(fd, len(mv))
        except OSError as e:
            raise self._io_error(e, doing) from e

    def _written(self, fd: int, nbytes: int) -> None:
        """Bounds the page cache the writes leave dirty: every ``DIRTY_BYTES`` written (the writer
        thread only), the file is synced and its pages dropped, so a state larger than memory is
        never held in the page cache waiting for writeback (a memory-limited job is charged for
        it), much as DeepSpeed's direct I/O bypasses the cache."""
        self._dirty += nbytes
        if self._dirty >= DIRTY_BYTES:
            os.fdatasync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self._dirty = 0

    def _io_error(self, e: OSError, doing: str, what: str = "optimizer state") -> NvmeError:
        if isinstance(e, NvmeError):
            return e
        fix = (f"free space on the drive (each step needs the second slot, {self.per_element} bytes per "
               "element) and retry the step; the last committed step is intact"
               if e.errno in (_errno.ENOSPC, _errno.EDQUOT) else
               "check the drive (dmesg, smartctl) and retry; the last committed step is intact")
        return NvmeError(self.path, f"{doing} {what} failed: "
                         f"{e.strerror or e}", fix, e.errno or 0)

    @staticmethod
    def _wait(futures) -> None:
        for f in futures:
            f.result()

    @staticmethod
    def _drain(futures) -> None:
        for f in futures:
            f.exception()  # waits; the first error is already propagating

    def _read_marker_if_present(self):
        try:
            with open(self._marker) as f:
                marker = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise NvmeError(self.path, f"the {_MARKER} marker cannot be read ({e})",
                            "restore it from a backup or delete the directory's contents "
                            "to start afresh") from e
        if marker.get("params_dtype", None) != self._params_name:
            raise NvmeError(self.path, f"holds a state with params_dtype {marker.get('params_dtype')}, "
                            f"not {self._params_name}",
                            "use another directory, or delete this one to start afresh")
        if marker.get("num_elements") != self.num_elements:
            raise NvmeError(self.path, f"holds a state of {marker.get('num_elements')} "
                            f"elements, not {self.num_elements}",
                            "use another directory, or delete this one to start afresh")
        return marker

    def _commit(self, slot: int, count: int, extra: Optional[dict] = None) -> None:
        tmp = self._marker + ".tmp"
        pdt = self._params_name
        marker = {**(extra or {}), "slot": slot, "count": count, "num_elements": self.num_elements,
                  "params_dtype": pdt, "generation": int((self.marker or {}).get("generation", 0)) + 1,
                  "layout": "master, m, v: fp32, num_elements each" + (f"; params: {pdt}" if pdt else "")}
        data = json.dumps(marker)
        try:
            with open(tmp, "w") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self._marker)  # atomic: the marker is old or new, never torn
            if self.fsync:
                dfd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as e:
            raise self._io_error(e, "committing") from e
        self._slot, self.committed_count, self.marker = slot, count, marker
