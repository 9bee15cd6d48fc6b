"""A server the benchmark starts and stops itself (`folio bench serve --peer ...`): one child
process in a session of its own, with everything it spawns; ready when an HTTP route answers
200; its memory summed over the whole process tree; stopped with SIGTERM, then SIGKILL after
a timeout, with no process left behind (also when the benchmark raises or is interrupted).

Every process of the tree is remembered as it is seen (at start, readiness and each memory
reading, and just before stopping), so a child that left the process group (a new session, a
daemon) is still killed by its pid.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

import psutil


class ServerExited(RuntimeError):
    """The server's process ended before it was ready (or while it was used)."""

    def __init__(self, name: str, returncode: int | None, log_tail: str,
                 when: str = "before it was ready") -> None:
        how = f"exit code {returncode}"
        if returncode is not None and returncode < 0:
            try:
                how = f"killed by {signal.Signals(-returncode).name}"
            except ValueError:
                pass
        super().__init__(f"{name} exited {when} ({how})"
                         + (f"; last log lines:\n{log_tail}" if log_tail else ""))
        self.returncode = returncode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it; a small race with other programs
    remains, as with any such choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants that are alive now ([] if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_memory(pid: int, pss: bool = True) -> dict[str, Any]:
    """Memory of the process `pid` and its descendants: the sum of their RSS (what `ps` shows
    per process; pages shared between them, such as libraries, count once per process), and
    the sum of their PSS (shared pages split between the processes that map them: the tree's
    own share of memory) where /proc allows reading it and `pss` asks for it (reading it walks
    every mapping: not for frequent sampling)."""
    rss = 0
    pss_sum: int | None = 0 if pss else None
    processes = []
    for proc in process_tree(pid):
        proc_pss = None
        try:
            with proc.oneshot():
                info = proc.memory_info()
                name = proc.name()
                if pss:
                    try:
                        proc_pss = getattr(proc.memory_full_info(), "pss", None)
                    except (psutil.AccessDenied, psutil.ZombieProcess):
                        proc_pss = None
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        rss += info.rss
        if pss_sum is not None:
            pss_sum = pss_sum + proc_pss if proc_pss is not None else None
        processes.append({"pid": proc.pid, "name": name, "rss_bytes": info.rss,
                          "pss_bytes": proc_pss})
    return {"rss_bytes": rss, "pss_bytes": pss_sum, "num_processes": len(processes),
            "processes": processes}


def _cpu_seconds(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        total += times.user + times.system
    return total


def cpu_snapshot(server_procs: Sequence[psutil.Process]) -> dict[str, float]:
    """CPU seconds so far: the machine's (busy, steal), the server's processes', and this
    (the benchmark client's) process's. Two snapshots give `cpu_usage`."""
    machine = psutil.cpu_times()
    idle = machine.idle + getattr(machine, "iowait", 0.0)
    steal = getattr(machine, "steal", 0.0)
    # Linux counts guest time inside user time as well: once only.
    total = sum(machine) - getattr(machine, "guest", 0.0) - getattr(machine, "guest_nice", 0.0)
    return {"wall": time.monotonic(), "busy": total - idle - steal, "steal": steal,
            "server": _cpu_seconds(server_procs), "client": _cpu_seconds([psutil.Process()])}


def cpu_usage(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two snapshots: by the server, by the benchmark client, by
    every other process of the machine (a busy neighbour shows here: llama.cpp's threads wait
    for each other at every op, so it loses far more to one than its share), and stolen by the
    hypervisor; with the wall time."""
    delta = {key: after[key] - before[key] for key in before}
    return {"wall_s": delta["wall"], "server_s": delta["server"], "client_s": delta["client"],
            "other_s": max(0.0, delta["busy"] - delta["server"] - delta["client"]),
            "steal_s": delta["steal"]}


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200 (proxies from the environment are not used)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited process its new parent has not reaped yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` s for `procs` to end; return those still running."""
    end = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.05)


class ServerProcess:
    """One server the benchmark runs: `with ServerProcess(...) as server:` starts it (in its own
    session, so Ctrl-C in the terminal reaches the benchmark, which stops it, and not the server
    directly), and leaving the block stops it, however the block ends."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: str,
                 env: dict[str, str] | None = None, stop_timeout: float = 20.0) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = env
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self._seen: dict[int, psutil.Process] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        self._remember()

    def wait_ready(self, url: str, timeout: float, poll_s: float = 0.25) -> float:
        """Block until GET `url` answers 200; return the seconds it took. ServerExited if the
        process ends first, TimeoutError after `timeout` seconds."""
        assert self.proc is not None, "start() first"
        start = time.monotonic()
        while True:
            self._remember()
            if self.proc.poll() is not None:
                raise ServerExited(self.name, self.proc.returncode, self.log_tail())
            if http_ok(url):
                self._remember()
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{self.name} was not ready at {url} after {timeout:g} s; "
                                   f"last log lines:\n{self.log_tail()}")
            time.sleep(poll_s)

    def memory(self, pss: bool = True) -> dict[str, Any]:
        assert self.proc is not None, "start() first"
        self._remember()
        return tree_memory(self.proc.pid, pss=pss)

    def tree(self) -> list[psutil.Process]:
        """The server's processes alive now (remembered for the stop)."""
        assert self.proc is not None, "start() first"
        self._remember()
        return process_tree(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exits_within(self, timeout: float) -> bool:
        """Whether the server's process ends within `timeout` seconds (is ended already)."""
        if self.proc is None:
            return False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> int | None:
        """SIGTERM to the server's process group and every process of its tree seen so far;
        SIGKILL to whatever is left after `stop_timeout` seconds. Returns the server's exit
        status. Ctrl-C is ignored meanwhile (in the main thread), so a second one cannot leave
        the tree half stopped; every wait here is bounded."""
        if self.proc is None:
            return None
        restore = None
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return self._stop()
        finally:
            if restore is not None:
                signal.signal(signal.SIGINT, restore)

    def _stop(self) -> int | None:
        assert self.proc is not None
        self._remember()
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group's id
        self._signal_all(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        # Children may outlive the server for a moment (or ignore SIGTERM): wait for the rest of
        # the tree within what is left of the timeout, then kill.
        others = [p for p in self._seen.values() if p.pid != self.proc.pid]
        alive = _wait_gone(others, timeout=max(0.5, self.stop_timeout / 4))
        if self.proc.poll() is None or alive:
            self._signal_all(pgid, signal.SIGKILL)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
                pass
            _wait_gone(others, timeout=10)
        return self.proc.returncode

    def _signal_all(self, pgid: int, sig: signal.Signals) -> None:
        """`sig` once to every process: the group at once, then each process seen that left
        the group (one signal each: llama-server takes a second SIGTERM as "terminate
        immediately" and aborts)."""
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in list(self._seen.values()):
            try:
                # is_running() compares the creation time: a reused pid is not signalled.
                if proc.is_running() and os.getpgid(proc.pid) != pgid:
                    proc.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                pass

    def _remember(self) -> None:
        if self.proc is None:
            return
        for proc in process_tree(self.proc.pid):
            self._seen.setdefault(proc.pid, proc)

    @property
    def pids(self) -> list[int]:
        """Every pid of the server's tree seen so far."""
        return sorted(self._seen)

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip()
        except OSError:
            return ""

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
