"""Run a function on N ranks as local processes — how examples and tests run multi-rank without a launcher.

    from triton_dist.launch import RankPool
    with RankPool(2) as pool:              # starts 2 ranks (CPU: Triton interpreter + shared-memory heap)
        results = pool.run(my_fn, arg)     # my_fn(arg) on every rank; returns [result of rank 0, rank 1]

Ranks start once and serve many calls (starting one costs seconds of imports). A call that raises on any rank,
or does not finish in time, raises here with every rank's error, and the pool restarts so that the next call
begins from clean state.

``RankPool(4, backend="shared-gpu")`` runs 4 ranks on one GPU (docs/design/shmem.md): the pool starts the MPS
daemon when none runs (so that the ranks' kernels are co-resident), gives each rank an equal share of the SMs,
and runs one call at a time per machine (the ranks of two pools waiting on their peers could fill the GPU), or
several whose shares add up to the GPU (``TRITON_DIST_SHARED_GPU_RANKS``).
"""

import contextlib
import fcntl
import gc
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
import time
import traceback
import warnings


AFTER_AN_ERROR_S = 30  # how long the other ranks of a call may still take once one rank has failed


class RankError(RuntimeError):
    pass


def _worker(rank, world, port, backend, heap_size, wait_timeout_s, conn):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch

    import triton_dist as td

    try:
        if backend != "cpu":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        td.init(backend=backend, heap_size=heap_size, wait_timeout_s=wait_timeout_s)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result = fn(*args, **kwargs)
            gc.collect()  # free symmetric tensors now, identically on every rank
            td.shmem.check_errors()
            if backend != "cpu":  # other processes' ranks may share the GPU: give back what this task cached
                torch.cuda.empty_cache()
            conn.send(("ok", result))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    td.finalize()
    conn.send(("bye", None))


_DRAINED = "drained"


def _synchronize():
    """A rank's last task before a pool stops it (``RankPool._drain``): wait for its device work. Never raises:
    the failure was reported with the call, and the rank's recorded error is cleared so that the worker's check
    after the task does not report it twice."""
    import torch

    import triton_dist as td

    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        td.shmem.clear_errors()
    except Exception:  # noqa: BLE001  (a device fault: nothing left to wait for)
        pass
    return _DRAINED


def mps_running():
    """Whether an MPS control daemon answers (on the pipe directory of ``CUDA_MPS_PIPE_DIRECTORY``)."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return False
    try:
        done = subprocess.run([exe], input="get_server_list\n", capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "Cannot find MPS control daemon" not in done.stdout + done.stderr


def start_mps():
    """Start the MPS control daemon unless one runs. None when it runs, else why it cannot (the ranks of a GPU
    then time-slice: correct, but every wait on a peer costs milliseconds). It stays up for later pools; stop it
    with ``echo quit | nvidia-cuda-mps-control``."""
    if mps_running():  # the user's daemon (its pipe directory in the environment, or the default one)
        return None
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return "nvidia-cuda-mps-control is not on PATH"
    for var, sub in (("CUDA_MPS_PIPE_DIRECTORY", "pipe"), ("CUDA_MPS_LOG_DIRECTORY", "log")):
        os.makedirs(os.environ.setdefault(var, os.path.join(tempfile.gettempdir(), f"triton_dist_mps_{sub}")),
                    exist_ok=True)
    if mps_running():  # started by another process of ours (e.g. another test worker)
        return None
    try:
        done = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-cuda-mps-control -d failed: {exc}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if mps_running():
            return None
        time.sleep(0.2)
    return f"nvidia-cuda-mps-control -d did not start a daemon (exit {done.returncode}: {done.stderr.strip()})"


def shared_gpu_ranks(ranks_per_gpu):
    """How many ranks of shared-GPU pools may run on one GPU at once: ``TRITON_DIST_SHARED_GPU_RANKS`` (the same in
    every process of the machine), at least one pool's ranks per GPU; by default exactly those (one call at a
    time). Each rank gets an equal part of the GPU for that many (``100 // shared_gpu_ranks`` percent)."""
    want = os.environ.get("TRITON_DIST_SHARED_GPU_RANKS", "")
    return max(ranks_per_gpu, int(want) if want.strip() else 0)


@contextlib.contextmanager
def _shared_gpu_shares(needed, capacity):
    """Holds ``needed`` of the machine's ``capacity`` rank shares of a GPU (one file lock each) while a call of
    several ranks per GPU runs. A rank's waiting grid fills its share; while the shares held add up to at most the
    whole GPU, every rank of every running call can still be resident, so no two calls starve each other's peers.
    Shares are taken all at once under a guard lock (never some held while waiting for the rest)."""
    tmp = tempfile.gettempdir()
    locks = [open(os.path.join(tmp, f"triton_dist_shared_gpu.{i}.lock"), "w") for i in range(capacity)]
    held = []
    try:
        while True:
            with open(os.path.join(tmp, "triton_dist_shared_gpu.lock"), "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                try:
                    for lock in locks:
                        if len(held) == needed:
                            break
                        try:
                            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                            held.append(lock)
                        except BlockingIOError:
                            pass
                    if len(held) < needed:
                        for lock in held:
                            fcntl.flock(lock, fcntl.LOCK_UN)
                        held = []
                finally:
                    fcntl.flock(guard, fcntl.LOCK_UN)
            if held:
                break
            time.sleep(0.05)
        yield
    finally:
        for lock in held:
            fcntl.flock(lock, fcntl.LOCK_UN)
        for lock in locks:
            lock.close()


class RankPool:
    def __init__(self, world, backend="cpu", heap_size=None, start_timeout=120, wait_timeout_s=None):
        """``backend``: "cpu" (interpreter ranks), a GPU backend ("auto", "cuda", "nvshmem": rank r on GPU
        r mod the GPU count) or "shared-gpu" (the ranks share the GPUs, e.g. 4 ranks on one). ``mode``: how
        the ranks run ("cpu", "gpu", "mps" or "time-sliced")."""
        self.world, self.backend, self.heap_size, self.start_timeout = world, backend, heap_size, start_timeout
        self.wait_timeout_s = wait_timeout_s
        self.mode = "cpu" if backend == "cpu" else "gpu"
        self._procs = []
        if backend == "shared-gpu":
            why = start_mps()
            self.mode = "mps" if why is None else "time-sliced"
            if why is not None:
                warnings.warn(f"{world} ranks share the GPU without MPS ({why}): their kernels time-slice, so "
                              f"every wait on a peer costs milliseconds")
        self._start()

    def _start(self, attempts=3):
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RankError as exc:  # another process bound the free port before rank 0 did: a new one
                if "EADDRINUSE" not in str(exc) or attempt == attempts - 1:
                    raise

    def _start_once(self):
        from .shmem.heap import _free_port

        ctx = mp.get_context("spawn")
        port = _free_port()
        self._conns, self._procs = [], []
        # the ranks inherit the environment when they start: interpreter ranks on CPU, compiled kernels on GPU;
        # ranks sharing a GPU under MPS each get an equal part of its SMs
        saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
        os.environ["TRITON_INTERPRET"] = "1" if self.backend == "cpu" else "0"
        if self.mode == "mps":
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // shared_gpu_ranks(self._ranks_per_gpu()))
        try:
            for r in range(self.world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(r, self.world, port, self.backend, self.heap_size,
                                                      self.wait_timeout_s, child), daemon=True)
                p.start()
                self._conns.append(parent)
                self._procs.append(p)
        finally:
            for k, v in saved.items():
                if k == "TRITON_INTERPRET" and self.backend == "cpu":
                    continue  # a CPU pool's setting stays: this process may run interpreted kernels too
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._collect(self.start_timeout, "start")

    def _collect(self, timeout, what):
        deadline = time.monotonic() + timeout
        results, errors = [None] * self.world, []
        pending = set(range(self.world))
        while pending:
            for r in list(pending):
                if self._conns[r].poll(0.01):
                    try:
                        kind, value = self._conns[r].recv()
                    except (EOFError, OSError):  # its process is gone (a reset connection too)
                        kind, value = "err", f"process died (exit code {self._procs[r].exitcode})"
                    pending.discard(r)
                    if kind == "err":
                        errors.append(f"--- rank {r} ---\n{value}")
                        # the others may wait in a collective for the failed rank: give them a short while
                        deadline = min(deadline, time.monotonic() + AFTER_AN_ERROR_S)
                    results[r] = value
                elif not self._procs[r].is_alive():
                    pending.discard(r)
                    errors.append(f"--- rank {r} --- process died (exit code {self._procs[r].exitcode})")
            if pending and time.monotonic() > deadline:
                late = "after another rank failed" if errors else f"within {timeout} s"
                errors.append(f"ranks {sorted(pending)} did not finish {what} {late}")
                break
        if errors:
            if self.backend == "shared-gpu":
                self._drain((self.wait_timeout_s or 60) + AFTER_AN_ERROR_S)
            self._kill()
            raise RankError("\n".join(errors))
        return results

    def _drain(self, timeout):
        """Before ranks that share a GPU are stopped: every rank's device work finished. A rank's heap goes with its
        process, and a peer's kernel still touching it would fault, which under MPS stops every client of the GPU
        (other pools' ranks too). Kernels end within a wait budget once a rank has failed, so this is bounded;
        a rank still in the failed call answers that first. The ranks that answered, in rank order."""
        for c in self._conns:
            try:
                c.send((_synchronize, (), {}))
            except OSError:  # its process is gone
                pass
        deadline = time.monotonic() + timeout
        pending, drained = set(range(self.world)), []
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                if self._conns[r].poll(0.01):
                    try:
                        kind, value = self._conns[r].recv()
                    except (EOFError, OSError):  # its process is gone: nothing of it to drain
                        pending.discard(r)
                        continue
                    if (kind, value) == ("ok", _DRAINED):
                        pending.discard(r)
                        drained.append(r)
                elif not self._procs[r].is_alive():
                    pending.discard(r)
        return drained

    def run(self, fn, *args, timeout=300, **kwargs):
        """``fn(*args, **kwargs)`` on every rank; the list of per-rank results."""
        if not self._procs:
            self._start()
        if self.backend == "shared-gpu":
            per_gpu = self._ranks_per_gpu()
            shares = _shared_gpu_shares(per_gpu, shared_gpu_ranks(per_gpu))
        else:
            shares = contextlib.nullcontext()
        with shares:
            for c in self._conns:
                c.send((fn, args, kwargs))
            return self._collect(timeout, getattr(fn, "__name__", repr(fn)))

    def _ranks_per_gpu(self):
        import torch

        return -(-self.world // max(1, torch.cuda.device_count()))

    def _kill(self):
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(5)
        self._procs = []

    def close(self):
        if not self._procs:
            return
        try:
            for c in self._conns:
                c.send(None)
            self._collect(30, "finalize")
        except Exception:
            pass
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def spawn(fn, world, *args, backend="cpu", **kwargs):
    """Start ``world`` ranks, run ``fn(*args, **kwargs)`` on each, stop them; the per-rank results."""
    with RankPool(world, backend=backend) as pool:
        return pool.run(fn, *args, **kwargs)


def run_main(main, world=2, **init_kwargs):
    """Entry point for examples: under torchrun (or on a GPU machine) this process is a rank — init, ``main()``,
    finalize; with no GPU (or ``TRITON_INTERPRET=1``), start ``world`` CPU ranks (the Triton interpreter) and run
    ``main()`` on each."""
    import torch

    if "LOCAL_RANK" in os.environ or (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
        import triton_dist as td

        td.init(**init_kwargs)
        try:
            main()
        finally:
            td.finalize()
    else:
        spawn(main, world)  # CPU ranks keep the default (sparse) heap
