"""A real multi-node Ray cluster on this machine, sealed in namespaces that the test creates.

Ray binds every interface and probes the network, so nothing of it may run on the host's network:
the cluster lives in a new network namespace (only loopback, brought up here), a new PID namespace
and a mount namespace with its own ``/proc``.  The namespace's PID 1 is a small reaper (daemonized Ray
processes are re-parented to it and must be reaped, or ``ray stop`` waits on zombies) with a deadline.
Every process of the cluster (head, workers, the drivers the tests run) is started inside with
``nsenter``.

Teardown: ``ray stop --force`` inside the namespaces (it sees only the namespace's processes), then the
``unshare`` process is killed by its PID; ``--kill-child`` makes that kill PID 1, and the kernel kills
every process left in a PID namespace whose PID 1 dies.  :meth:`RayCluster.stop` then checks, by
scanning ``/proc`` for the namespace, that no process is left (bounded wait), kills any it finds by
PID, and reports them.

Where the namespaces cannot be created (no privilege, no ``unshare``/``nsenter``/``ip``), the tests
skip with the reason; they never fall back to Ray on the host network.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HEAD_PORT = 6379
ADDRESS = f"127.0.0.1:{HEAD_PORT}"
OBJECT_STORE = 100_000_000

_REAPER = r"""
import os, signal, sys, time
deadline = time.monotonic() + float(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while time.monotonic() < deadline:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.1)
    except ChildProcessError:
        time.sleep(0.1)
"""


def namespace_problem() -> str | None:
    """Why the namespaces cannot be created here, or None when they can."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        r = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount-proc", "sh", "-c", "ip link set lo up"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if r.returncode != 0:
        return f"cannot create network/PID namespaces (unshare: {r.stderr.strip() or r.returncode})"
    return None


def _pid_ns(pid: int):
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class RayCluster:
    """``workers`` + 1 Ray nodes of ``cpus`` CPUs each (head included), started with ``ray start``."""

    def __init__(self, *, workers: int = 1, cpus: int = 1, lifetime: float = 900.0):
        self.workers = workers
        self.cpus = cpus
        self.lifetime = lifetime
        self.holder = None
        self.init_pid = None
        self.ns = None
        self.temp = tempfile.mkdtemp(prefix="mcfray", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
        # the `ray` console script through this interpreter: a venv made with --system-site-packages has no
        # script of its own next to python, and the one on PATH may belong to another interpreter
        self.ray = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; "
                    "sys.exit(main())"]
        # a private HOME: Ray keeps state there (~/.ray/auth_token, written when a driver starts a local
        # instance, turns token authentication on for every later head started under that HOME)
        self.home = os.path.join(self.temp, "home")
        os.makedirs(self.home)
        self.env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", HOME=self.home)
        self.env.pop("RAY_ADDRESS", None)
        self.leftovers: list = []
        self.log: list = []

    # -- running things inside ------------------------------------------------------------------------
    def command(self, argv) -> list:
        return ["nsenter", "-t", str(self.init_pid), "--net", "--pid", "--mount", "--"] + list(argv)

    def run(self, argv, *, timeout: float, env=None, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        r = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout,
                           env=dict(self.env, **(env or {})), cwd=cwd)
        self.log.append((argv, r.returncode, r.stdout[-4000:], r.stderr[-4000:]))
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, argv))} exited {r.returncode}\nstdout:\n{r.stdout[-4000:]}\n"
                                 f"stderr:\n{r.stderr[-6000:]}")
        return r

    def popen(self, argv, *, env=None, cwd=None) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(self.env, **(env or {})), cwd=cwd)

    def python(self, *args, timeout: float, env=None, check: bool = True) -> subprocess.CompletedProcess:
        return self.run([sys.executable, *args], timeout=timeout, env=env, check=check)

    # -- processes of the namespace -------------------------------------------------------------------
    def processes(self) -> dict:
        """``{host pid: command line}`` of every process in the cluster's PID namespace."""
        out = {}
        if self.ns is None:
            return out
        for name in os.listdir("/proc"):
            if name.isdigit() and _pid_ns(int(name)) == self.ns:
                out[int(name)] = _cmdline(int(name))
        return out

    def find(self, needle: str) -> list:
        return [p for p, c in self.processes().items() if needle in c]

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the processes now alive in the namespace."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass
        return total / tick

    def settle(self, *, busy: float = 0.05, window: float = 2.0, timeout: float = 90.0) -> tuple:
        """Wait until the cluster is idle: its processes use less than ``busy`` of a core over ``window``
        seconds (a node that has just joined goes on starting its agents for tens of seconds after it
        registers, on the cores the next job would use).  Returns ``(seconds waited, CPU-seconds the
        cluster used meanwhile)``; gives up after ``timeout`` seconds."""
        t0 = time.monotonic()
        first = prev = self.cpu_seconds()
        while time.monotonic() - t0 < timeout:
            time.sleep(window)
            now = self.cpu_seconds()
            if now - prev < busy * window:
                break
            prev = now
        return time.monotonic() - t0, self.cpu_seconds() - first

    # -- lifetime -------------------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame):
        raise KeyboardInterrupt("SIGTERM")      # so that finally blocks and fixture teardowns stop the cluster

    def start(self) -> "RayCluster":
        import threading

        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.holder = subprocess.Popen(["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc",
                                        sys.executable, "-c", _REAPER, str(self.lifetime)],
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while self.init_pid is None:
            if time.monotonic() > deadline or self.holder.poll() is not None:
                raise RuntimeError("the namespace holder did not start")
            try:
                with open(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children") as f:
                    kids = f.read().split()
                if kids:
                    self.init_pid = int(kids[0])
            except OSError:
                pass
            time.sleep(0.02)
        self.ns = _pid_ns(self.init_pid)
        self.run(["ip", "link", "set", "lo", "up"], timeout=30)
        common = ["--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus}", f"--object-store-memory={OBJECT_STORE}",
                  "--disable-usage-stats"]
        self.run([*self.ray, "start", "--head", f"--port={HEAD_PORT}", "--include-dashboard=false",
                  f"--temp-dir={self.temp}", *common], timeout=120)
        for w in range(self.workers):
            base = 52400 + 10 * w
            self.run([*self.ray, "start", f"--address={ADDRESS}", *common,
                      f"--dashboard-agent-listen-port={base}", f"--dashboard-agent-grpc-port={base + 1}",
                      f"--runtime-env-agent-port={base + 2}", f"--metrics-export-port={base + 3}"], timeout=120)
        self.wait_nodes(self.workers + 1, timeout=60)
        return self

    def wait_nodes(self, n: int, *, timeout: float) -> None:
        code = ("import ray, sys, time\n"
                f"ray.init(address='{ADDRESS}', logging_level='ERROR')\n"
                f"d = time.monotonic() + {timeout}\n"
                f"while sum(x['Alive'] for x in ray.nodes()) < {n} and time.monotonic() < d: time.sleep(0.2)\n"
                f"sys.exit(0 if sum(x['Alive'] for x in ray.nodes()) >= {n} else 1)\n")
        self.python("-c", code, timeout=timeout + 60)

    def stop(self) -> list:
        """Stop everything; returns the processes that had to be killed after ``ray stop`` and PID 1's
        death (empty when the teardown was clean)."""
        if self.holder is None:
            return []
        try:
            if self.init_pid is not None and self.holder.poll() is None:
                try:
                    self.run([*self.ray, "stop", "--force"], timeout=90, check=False)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if self.holder.poll() is None:
                os.kill(self.holder.pid, signal.SIGKILL)      # --kill-child takes PID 1, and with it the namespace
            try:
                self.holder.wait(30)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 30
            left = self.processes()
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self.processes()
            for pid, cmd in left.items():
                self.leftovers.append((pid, cmd))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.holder = None
            shutil.rmtree(self.temp, ignore_errors=True)
            if getattr(self, "_old_sigterm", None) is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
        return self.leftovers
