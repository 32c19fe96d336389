"""A start of the app measured from outside: time to the first live tree, time until captured steps serve, and the
peak resident memory of the app plus every process it started.

    python -m scripts.app_start --cache $(mktemp -d) --json first.json              # a first start (empty cache)
    python -m scripts.app_start --cache DIR --second-start --json starts.json        # then a second on the same cache
    python -m scripts.as_cpu avx2 -- \\
        python -m scripts.app_start --cache $(mktemp -d) --json avx2.json            # as an AVX2-only CPU would

Runs `python app.py --pair PAIR --port P` as a subprocess in its own session and process group, with this
environment (so an emulated CPU class reaches it; `--cache DIR` sets TREEVIZ_CACHE). Per start, in seconds from
the app's process start:

  page_s          the page is served (GET / answers 200)
  first_tree_s    /run (gradio_client, on a code prompt, the page's own settings unless given) streams its first
                  update holding a tree; run_done_s when that run ends
  captured        the app's log line `captured steps serving: ...` (or `captured steps unavailable ...`), or
                  "timeout" --capture-timeout s after the start, "app exited" (its exit code: -9 is the OOM
                  killer's SIGKILL) if it ended first, "not waited" with --no-capture-wait
  memory          VmRSS of the app and every descendant (a builder and its compilers included, also after they
                  are re-parented), sampled every 0.5 s: the peak total, the processes at that moment, each
                  process's own peak (VmHWM, which the kernel keeps between samples), and the sum of those peaks
                  (an upper bound on the total); with --pss, also the peak of the processes' summed Pss
                  (smaps_rollup, every 2 s), which counts a page two processes share once (the app and its builder
                  map the same checkpoint files: their VmRSS sum counts those pages twice). Off by default:
                  reading smaps_rollup walks a process's pages, ~25 ms per 4 GiB of the app's cores' time, and
                  the app caches a measurement only where no other process took that much of its cores

Then it ends the app as Ctrl-C would (SIGINT: its exit hooks run), its process group (SIGTERM, then SIGKILL), and
any process of its tree still alive a few seconds later (reported as `outlived_app`: a builder that did not end with
its app shows up here), also on Ctrl-C or an error in this script. Prints a summary; --json writes every number,
the command, the CPU (model name, torch's capability), the environment that emulates a CPU class, the date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from engine.core.prompts import load_prompt_set
from engine.cpu.build_guard import GiB, identities, kill_tree, proc_stat
from engine.measure import costs
from scripts.ui_latency import free_port, has_tree

REPOSITORY = Path(__file__).resolve().parents[1]
SERVING, UNAVAILABLE = "captured steps serving:", "captured steps unavailable"
EMULATION = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
             "FBGEMM_ENABLE_INSTRUCTIONS")
SAMPLE_S = 0.5
PSS_EVERY = 4  # samples: reading smaps_rollup walks a process's pages (~25 ms per 4 GiB), so Pss is summed every 2 s


# -- the process tree and its memory ----------------------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def role(name: str, command: str) -> str:
    """A short name for a process of the tree: app, builder, inductor (its compile workers and kernel checks),
    else the executable's (g++, cc1plus, ...)."""
    for marker, label in (("app.py", "app"), ("-m engine build", "builder"), ("torchinductor", "inductor"),
                          ("torch._inductor", "inductor")):
        if marker in command:
            return label
    return name


def _kib(status: str, field: str) -> int:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class ProcessTree:
    """The app's process and everything it starts, sampled every SAMPLE_S s in a thread: a process belongs to the
    tree if it descends from the app, from a process seen in the tree before (an orphan keeps its place), or shares
    the app's process group. Identities are (pid, start time), so a reused pid is never counted or signalled."""

    def __init__(self, root: int, t0: float, pss: bool = False):
        self.root, self.t0, self.pss = root, t0, pss
        self.seen: dict[tuple[int, int], dict] = {}  # (pid, start) -> {pid, name, command, start_ticks, peaks, ...}
        self.peak = {"total_bytes": 0, "t_s": None, "processes": []}
        self.peak_pss = {"total_bytes": 0, "t_s": None}
        self.samples = 0
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="process-tree")

    def start(self) -> ProcessTree:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(SAMPLE_S):
                return

    def members(self) -> dict[int, int]:
        """{pid: start time} of the tree's live processes, now."""
        stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := proc_stat(int(p))) is not None}
        known = {pid for pid, start in self.seen if stats.get(pid, (0, 0, None))[2] == start}
        inside = {p for p, (_, group, _) in stats.items() if p == self.root or group == self.root} | known
        grew = True
        while grew:  # add the children of every member until nothing new
            more = {p for p, (parent, _, _) in stats.items() if parent in inside and p not in inside}
            inside |= more
            grew = bool(more)
        return {p: stats[p][2] for p in inside if p in stats}

    def sample(self) -> None:
        now = round(time.monotonic() - self.t0, 2)
        total, pss, at = 0, 0, []
        with self._lock:
            for pid, start in self.members().items():
                status = _read(f"/proc/{pid}/status")
                rss, hwm = _kib(status, "VmRSS"), _kib(status, "VmHWM")
                if not status:
                    continue
                if (pid, start) not in self.seen:
                    command = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
                    self.seen[(pid, start)] = {"pid": pid, "name": role(_read(f"/proc/{pid}/comm").strip(), command),
                                               "command": command[:200], "start_ticks": start, "peak_rss_bytes": 0,
                                               "hwm_bytes": 0, "first_s": now}
                entry = self.seen[(pid, start)]
                entry["peak_rss_bytes"] = max(entry["peak_rss_bytes"], rss)
                entry["hwm_bytes"] = max(entry["hwm_bytes"], hwm)
                entry["last_s"] = now
                total += rss
                if self.pss and self.samples % PSS_EVERY == 0:
                    pss += _kib(_read(f"/proc/{pid}/smaps_rollup"), "Pss")
                at.append({"pid": pid, "name": entry["name"], "rss_bytes": rss})
            self.samples += 1
            if pss > self.peak_pss["total_bytes"]:
                self.peak_pss = {"total_bytes": pss, "t_s": now}
            if total > self.peak["total_bytes"]:
                self.peak = {"total_bytes": total, "t_s": now,
                             "processes": sorted(at, key=lambda p: -p["rss_bytes"])}

    def alive(self) -> dict[int, int]:
        """{pid: start time} of every process seen in the tree that is still alive."""
        with self._lock:
            return identities([pid for pid, start in self.seen if (s := proc_stat(pid)) and s[2] == start])

    def report(self) -> dict:
        with self._lock:
            processes = sorted(self.seen.values(), key=lambda p: -p["hwm_bytes"])
            return {"peak_total_bytes": self.peak["total_bytes"], "peak_at_s": self.peak["t_s"],
                    "peak_processes": self.peak["processes"],
                    "peak_pss_total_bytes": self.peak_pss["total_bytes"], "peak_pss_at_s": self.peak_pss["t_s"],
                    "hwm_sum_bytes": sum(p["hwm_bytes"] for p in processes),
                    "processes": processes, "samples": self.samples, "sample_s": SAMPLE_S}


# -- the app's log ----------------------------------------------------------------------------------------------------

class LogWatch:
    """Reads the app's merged output line by line in a thread, writes it to `log` stamped with seconds since the
    start, and keeps when the captured-steps line first came (`captured`: state, s, line)."""

    def __init__(self, stream, log: Path, t0: float):
        self.stream, self.log, self.t0 = stream, log, t0
        self.captured: dict | None = None
        self.seen = threading.Event()
        self.tail: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="app-log")

    def start(self) -> LogWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        with open(self.log, "a") as out:
            for line in self.stream:
                now = round(time.monotonic() - self.t0, 2)
                out.write(f"{now:9.2f}  {line}")
                out.flush()
                self.tail = (self.tail + [line.rstrip()])[-20:]
                for marker, state in ((SERVING, "serving"), (UNAVAILABLE, "unavailable")):
                    if marker in line and self.captured is None:
                        self.captured = {"state": state, "s": now, "line": line.strip()[-400:]}
                        self.seen.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


# -- one start --------------------------------------------------------------------------------------------------------

def app_command(args, port: int) -> list[str]:
    return [sys.executable, "app.py", "--pair", args.pair, "--port", str(port), "--host", "127.0.0.1"]


def app_env(args) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    if args.cache:
        env["TREEVIZ_CACHE"] = str(Path(args.cache).resolve())
    return env


def wait_for_page(url: str, app: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if app.poll() is not None:
            raise RuntimeError(f"the app exited with {app.returncode} before serving its page")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the page was not served within {timeout:.0f} s")


def first_tree(url: str, args, prompt: str, since) -> dict:
    """/run on the prompt with the page's own settings (overridden where given): seconds to its first update with a
    tree and to its end."""
    from gradio_client import Client
    client = Client(url, verbose=False)
    given = {"strategy": args.strategy, "preset": args.preset, "max_new_tokens": args.max_new_tokens}
    job = client.submit(prompt=prompt, chat=False, pair=args.pair, api_name="/run",
                        **{k: v for k, v in given.items() if v is not None})
    deadline, seen = time.monotonic() + args.tree_timeout, None
    while not job.done() and time.monotonic() < deadline:
        if seen is None and any(has_tree(o) for o in job.outputs()):
            seen = since()
        time.sleep(0.1)
    if seen is None and any(has_tree(o) for o in job.outputs()):
        seen = since()
    out = {"first_tree_s": seen, "run_done_s": since() if job.done() else None}
    outputs = job.outputs()
    if outputs:  # the run's last status line, as the page shows it (tags dropped)
        out["run_status"] = re.sub(r"<[^>]+>", "", str(outputs[-1][1]))[:300]
    if job.done():
        try:
            job.result()
        except Exception as err:  # noqa: BLE001 - the app's error, reported, not raised
            out["run_error"] = f"{type(err).__name__}: {err}"[:300]
    else:
        job.cancel()
        out["run_error"] = f"no end within {args.tree_timeout:.0f} s"
    return out


def sigint_reaches_children() -> None:
    """Let the app take the SIGINT `App.end` sends first: a job a non-interactive shell starts in the background
    ignores SIGINT, and an ignored signal stays ignored across exec, whereas a handler is reset to the default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class App:
    """One app process (`command`, in its own session and process group), its log and its process tree; `end()`
    ends them all."""

    def __init__(self, command: list[str], env: dict, log: Path, pss: bool = False):
        self.command, self.log = command, log
        self.t0 = time.monotonic()
        sigint_reaches_children()
        self.process = subprocess.Popen(command, cwd=REPOSITORY, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                        errors="replace", start_new_session=True)
        self.tree = ProcessTree(self.process.pid, self.t0, pss).start()
        self.watch = LogWatch(self.process.stdout, log, self.t0).start()
        self.ended: dict | None = None

    def since(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def end(self, grace: float = 5.0) -> dict:
        """SIGINT to the app (its exit hooks run), SIGTERM then SIGKILL to its process group, then SIGTERM / SIGKILL
        to every process of its tree still alive `grace` s after the app is gone (reported: they outlived it)."""
        if self.ended is not None:
            return self.ended
        self.tree.sample()
        how = "exited by itself" if self.process.poll() is not None else None
        for sig, name, wait in ((signal.SIGINT, "SIGINT", 15.0), (signal.SIGTERM, "SIGTERM", 5.0),
                                (signal.SIGKILL, "SIGKILL", 5.0)):
            if how is not None:
                break
            try:
                (os.kill if sig == signal.SIGINT else os.killpg)(self.process.pid, sig)
                self.process.wait(wait)
                how = name
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                how = how or "gone"
        try:  # the rest of its group, if any (what ignores this is killed below, with the rest of its tree)
            os.killpg(self.process.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + grace
        while self.tree.alive() and time.monotonic() < deadline:
            self.tree.sample()
            time.sleep(0.2)
        outlived = self.tree.alive()
        names = {e["pid"]: e["command"] for e in self.tree.report()["processes"]}
        needed_kill = kill_tree(outlived, grace=3.0)
        self.tree.stop()
        self.watch.join(timeout=5)
        self.ended = {"app_ended_by": how or "still alive", "exit_code": self.process.returncode,
                      "ended_s": self.since(), "outlived_app": [{"pid": p, "command": names.get(p, "")} for p in outlived],
                      "needed_sigkill": needed_kill, "left_alive": sorted(self.tree.alive())}
        return self.ended


def wait_for_capture(app: App, timeout: float) -> dict:
    """The captured-steps line (`LogWatch.captured`), or "timeout" `timeout` s after the app's start, or "app exited"
    (with its exit code: -9 is a SIGKILL, the OOM killer's) if it ends first."""
    while not app.watch.seen.wait(1.0):
        if app.process.poll() is not None:
            return {"state": "app exited", "s": app.since(), "exit_code": app.process.returncode}
        if app.since() >= timeout:
            return {"state": "timeout", "s": None, "after_s": timeout}
    return dict(app.watch.captured)


def measure_start(args, label: str, prompt: str, log: Path, out: dict) -> dict:
    """One start of the app, measured into `out` (module docstring; filled as it goes, so an error or Ctrl-C keeps
    what was measured), then ended."""
    port = free_port()
    app = App(app_command(args, port), app_env(args), log, args.pss)
    url = f"http://127.0.0.1:{port}/"
    out.update(label=label, command=app.command, app_pid=app.process.pid, log=str(log))
    try:
        wait_for_page(url, app.process, args.page_timeout)
        out["page_s"] = app.since()
        print(f"{label}: page served at {out['page_s']} s", flush=True)
        out.update(first_tree(url, args, prompt, app.since))
        print(f"{label}: first tree at {out['first_tree_s']} s, run done at {out['run_done_s']} s", flush=True)
        if args.no_capture_wait:
            out["captured"] = {"state": "not waited"}
        else:
            out["captured"] = wait_for_capture(app, args.capture_timeout)
            print(f"{label}: captured steps {out['captured']['state']} at {out['captured'].get('s')} s", flush=True)
    except BaseException as err:
        out["error"] = f"{type(err).__name__}: {err}"[:300]
        out["app_log_tail"] = app.watch.tail
        raise
    finally:
        out["memory"] = app.tree.report()  # kept should ending fail
        out["ended"] = app.end()
        out["memory"] = app.tree.report()  # with the samples taken while it ended
    return out


# -- the report -------------------------------------------------------------------------------------------------------

def cpu_info() -> dict:
    """The CPU as the report names it: its model, the ISA torch's kernels dispatch to here, cores, torch."""
    return {"model": costs.cpu_info()["name"], "capability": costs.cpu_capability(), "cores": os.cpu_count(),
            "torch": torch.__version__}


def emulation_env() -> dict:
    """The variables that make this machine act as another CPU class, and the app's and inductor's own."""
    names = set(EMULATION) | {k for k in os.environ if k.startswith(("TORCHINDUCTOR_", "TREEVIZ_"))}
    return {k: os.environ.get(k) for k in sorted(names)}


def summary(start: dict) -> str:
    """One line per start: the times, the peak and who made it, and anything that outlived the app."""
    memory, captured, ended = start.get("memory", {}), start.get("captured", {}), start.get("ended", {})
    tree = f"first tree {start.get('first_tree_s')} s"
    if not start.get("first_tree_s"):
        tree += f" (NO TREE: {start.get('run_status') or start.get('run_error')})"
    top = ", ".join(f"{p['name']} {p['rss_bytes'] / GiB:.1f}" for p in memory.get("peak_processes", [])[:4])
    peak = (f"peak {memory.get('peak_total_bytes', 0) / GiB:.2f} GiB at {memory.get('peak_at_s')} s ({top}; "
            f"sum of own peaks {memory.get('hwm_sum_bytes', 0) / GiB:.2f} GiB"
            + (f"; shared pages once (Pss) {memory['peak_pss_total_bytes'] / GiB:.2f} GiB at "
               f"{memory.get('peak_pss_at_s')} s)" if memory.get("peak_pss_total_bytes") else ")"))
    outlived = [p["command"][:60] for p in ended.get("outlived_app") or []]
    return (f"{start['label']}: page {start.get('page_s')} s, {tree}, captured steps {captured.get('state')} at "
            f"{captured.get('s')} s; {peak}; ended by {ended.get('app_ended_by')}"
            + (f"; OUTLIVED THE APP: {outlived}" if outlived else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default")
    parser.add_argument("--cache", help="TREEVIZ_CACHE for the app ($(mktemp -d): an empty cache, a first start)")
    parser.add_argument("--prompt-set", default="code", help="the first prompt of this set is the /run prompt")
    parser.add_argument("--strategy", help="default: the page's")
    parser.add_argument("--preset", help="default: the page's")
    parser.add_argument("--max-new-tokens", type=int, help="default: the page's")
    parser.add_argument("--page-timeout", type=float, default=600.0)
    parser.add_argument("--tree-timeout", type=float, default=1800.0, help="for the first run to end")
    parser.add_argument("--capture-timeout", type=float, default=1800.0,
                        help="seconds from the app's start to wait for its captured-steps line")
    parser.add_argument("--no-capture-wait", action="store_true", help="do not wait for the captured-steps line")
    parser.add_argument("--second-start", action="store_true", help="then start it again on the same cache")
    parser.add_argument("--log-dir", help="where the app's logs go (default: a new temporary folder)")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--pss", action="store_true",
                        help="also sum the processes' Pss every 2 s (it costs the app's cores CPU time: see above)")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # ends the app through the finally blocks
    prompt = next(p for p in load_prompt_set(args.prompt_set) if isinstance(p["prompt"], str))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="app-start-"))
    logs.mkdir(parents=True, exist_ok=True)
    report = {"command": [sys.executable, "-m", "scripts.app_start", *(argv if argv is not None else sys.argv[1:])],
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu_info(),
              "emulation": emulation_env(), "pair": args.pair, "cache": args.cache, "prompt": prompt["name"],
              "starts": []}
    code = 0
    try:
        for label in ("first start", "second start")[:2 if args.second_start else 1]:
            report["starts"].append(start := {"label": label})
            measure_start(args, label, prompt["prompt"], logs / f"{label.replace(' ', '-')}.log", start)
            print(summary(start), flush=True)
            code = code or (0 if start.get("first_tree_s") else 2)  # a start without a tree measured nothing
    except BaseException as err:  # noqa: BLE001 - Ctrl-C included: what was measured is still written
        report["error"] = f"{type(err).__name__}: {err}"[:300]
        print(f"stopped: {report['error']}", file=sys.stderr, flush=True)
        code = 130 if isinstance(err, KeyboardInterrupt) else 1
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
