"""Run a function in N real processes, started once by torchrun and reused.

Starting torchrun costs two torch imports (seconds); a test suite that started it per test would
spend its time there. `RankPool` starts ``N`` workers through ``torch.distributed.run`` once,
then runs one function per call on every rank. Each call gets a fresh rendezvous port, bound by
rank 0's store before any other rank hears of it (see `_reserve_port`), so a call's process group
never meets the previous one's, nor another pool's. A call that takes
longer than its timeout, or a rank that dies, fails the call with every rank's error and stops the
pool; the next call starts a new one. Nothing hangs forever.

The function must be importable by name (a module-level function) and its arguments and result
picklable. Inside it, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are set, as
torchrun sets them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from torchplug.plugins.torchrun import free_port


def _send(conn: Connection, obj: Any) -> None:
    # Plain pickle: Connection.send uses ForkingPickler, with which torch shares tensors through
    # file descriptors that the other process is not allowed to open.
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class RankError(AssertionError):
    """One or more ranks failed, or the call timed out; the message holds every rank's story."""


class RankPool:
    """``nprocs`` worker processes started by torchrun, each running calls sent to it."""

    #: The least time any call waits for its ranks, whatever ``timeout`` it passes: a suite
    #: that must not fail because the machine is slow raises it (on the class, for every pool;
    #: a call's timeout is then a hang guard, not a budget); 0 keeps each call's own.
    timeout_floor: float = 0.0

    def __init__(
        self,
        nprocs: int = 2,
        *,
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        sys_path: Sequence[str] | None = None,
    ) -> None:
        self.nprocs = nprocs
        self.start_timeout = start_timeout
        self.env = dict(env or {})
        #: What the ranks add to their sys.path: by default the caller's (see
        #: `default_sys_path`), so a function from the caller's own module (a test file,
        #: a script's directory) imports on the ranks as it did here; ``()`` adds nothing.
        self.sys_path = default_sys_path() if sys_path is None else list(sys_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._conns: dict[int, Connection] = {}
        self._pids: dict[int, int] = {}
        self._log: Any = None

    # -- lifetime -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._process is not None:
            return
        authkey = secrets.token_bytes(16)
        # a backlog for every rank: they connect at once, and with multiprocessing's default
        # of 1 the ones that overflow it wait out TCP's SYN retries (over 2 minutes at 8 ranks)
        listener = Listener(("127.0.0.1", 0), backlog=max(16, self.nprocs), authkey=authkey)
        host, port = listener.address
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the pool
        env = {
            **os.environ,
            **self.env,
            "TORCHPLUG_POOL_ADDRESS": f"{host}:{port}",
            "TORCHPLUG_POOL_AUTHKEY": authkey.hex(),
            "TORCHPLUG_POOL_PATH": os.pathsep.join(self.sys_path),
            "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS", "1"),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.nprocs}",
            "--max-restarts=0",
            "--monitor-interval=0.5",
            "-m",
            "torchplug.testing._rank_worker",
        ]
        self._process = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        conns: dict[int, Connection] = {}

        def accept() -> None:
            while len(conns) < self.nprocs:
                conn = listener.accept()
                rank, pid = _recv(conn)
                conns[rank] = conn
                self._pids[rank] = pid

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        thread.join(self.start_timeout)
        listener.close()
        if len(conns) < self.nprocs:
            output = self._output()
            self.stop()
            raise RankError(
                f"Only {len(conns)} of {self.nprocs} ranks started within "
                f"{self.start_timeout:.0f} s. torchrun said:\n{output}"
            )
        self._conns = conns

    def stop(self) -> None:
        for conn in self._conns.values():
            try:
                _send(conn, None)
                conn.close()
            except OSError:
                pass
        self._conns = {}
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, 9)
                self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill(self) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, 9)
        self.stop()

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask hung ranks to print where they are (faulthandler) before they are killed."""
        for rank in ranks:
            with contextlib.suppress(OSError, KeyError):
                os.kill(self._pids[rank], signal.SIGUSR2)
        time.sleep(1.0)

    def _output(self, limit: int = 6000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- calls ----------------------------------------------------------------------------------

    def _reserve_port(self) -> int:
        """A port on which rank 0 already hosts the call's store.

        A port that was merely free when this process looked could be taken before rank 0
        binds it, and the other ranks, which connect as soon as they hear of it, would then
        talk to whatever holds it: another test's store, closed under them later, left rank 0
        waiting out its whole timeout (seen in CI with two pytest-xdist workers). So rank 0
        binds first; the call's own ``TCPStore`` on that port (torch's ``env://`` and
        torchplug's rendezvous both ask for ``multi_tenant``) shares the server it holds.
        """
        conn = self._conns[0]
        said = f"no answer within {self.start_timeout:.0f} s"
        try:
            _send(conn, ("reserve",))
            if conn.poll(self.start_timeout):
                status, value = _recv(conn)
                if status == "port":
                    return int(value)
                said = value
        except (EOFError, OSError):
            said = "the process died (see torchrun output below)"
        output = self._output()
        self._kill()
        raise RankError(f"Rank 0 could not host a store for the call: {said}\n{output}")

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results, rank 0 first."""
        timeout = max(timeout, self.timeout_floor)
        if self._process is not None and self._process.poll() is not None:
            self.stop()  # torchrun ended (a rank died in an earlier call): start afresh
        self.start()
        task = (fn.__module__, fn.__qualname__, args, kwargs, self._reserve_port())
        for conn in self._conns.values():
            _send(conn, task)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(self._conns)
        died = False
        while pending:
            remaining = deadline - time.monotonic()
            if errors:  # the others may be stuck in a collective with the failed rank
                remaining = min(remaining, 10.0)
            if remaining <= 0:
                break
            for rank, conn in list(pending.items()):
                if not conn.poll(min(remaining, 0.05)):
                    continue
                try:
                    status, value = _recv(conn)
                except (EOFError, OSError):
                    status, value = "error", "the process died (see torchrun output below)"
                    died = True
                del pending[rank]
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
        if pending or errors:
            name = f"{fn.__module__}.{fn.__qualname__}"
            story = [f"{name} failed on {self.nprocs} ranks:"]
            for rank in sorted(errors):
                story.append(f"--- rank {rank} raised:\n{errors[rank]}")
            for rank in sorted(pending):
                story.append(f"--- rank {rank} did not finish within {timeout:.0f} s")
            if pending or died:
                self._dump_stacks(sorted(pending))
                story.append(f"--- torchrun output:\n{self._output()}")
                self._kill()
            raise RankError("\n".join(story))
        return [results[r] for r in sorted(results)]


def worker_loop() -> None:
    """The loop each rank runs: receive a task, run it, send back its result or traceback."""
    for entry in filter(None, os.environ.get("TORCHPLUG_POOL_PATH", "").split(os.pathsep)):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    host, port = os.environ["TORCHPLUG_POOL_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["TORCHPLUG_POOL_AUTHKEY"]))
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)  # USR1: a notice
    _send(conn, (int(os.environ["RANK"]), os.getpid()))
    # Each call hosts its own store on a fresh port instead of the agent's.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    base_env = dict(os.environ)
    while True:
        try:
            task = _recv(conn)
        except (EOFError, OSError):
            return
        if task is None:
            return
        if task == ("reserve",):
            _send(conn, _hold_port())
            continue
        module, qualname, args, kwargs, port = task
        os.environ.clear()
        os.environ.update(base_env)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        try:
            target: Any = importlib.import_module(module)
            for part in qualname.split("."):
                target = getattr(target, part)
            reply = ("ok", target(*args, **kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        finally:
            _cleanup()
        try:
            _send(conn, reply)
        except Exception:
            _send(conn, ("error", traceback.format_exc()))


#: Rank 0's store for the running call (see `RankPool._reserve_port`), dropped after it.
_held: list[Any] = []


def _hold_port() -> tuple[str, Any]:
    """Host a store on a free port, kept until the call ends; answer ``("port", n)``."""
    import torch.distributed as dist

    failed = ""
    for _ in range(16):
        port = free_port()
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                int(os.environ["WORLD_SIZE"]),
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
            )
        except Exception:  # taken between the look and the bind: take another
            failed = traceback.format_exc()
            continue
        _held.append(store)
        return "port", port
    return "error", f"16 free ports could not be bound; the last said:\n{failed}"


def _cleanup() -> None:
    """Leave the process as a new call expects it: no process group, no held store, fresh
    plugin registry."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    _held.clear()
    from torchplug.contract import manager

    manager.reset_registry(forget_blocks=True)


def default_sys_path() -> list[str]:
    """Directories a worker needs to import the caller's modules: the current sys.path (its
    empty entry, the current directory, made absolute)."""
    found = [os.path.abspath(p or os.curdir) for p in sys.path]
    return list(dict.fromkeys(p for p in found if Path(p).is_dir()))
