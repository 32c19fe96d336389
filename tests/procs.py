"""What /proc says of a process, and waiting for it to change, for tests that watch real processes."""
import time
from pathlib import Path


def stat_fields(stat_file: str | Path) -> list[str]:
    """The fields of a /proc/PID/stat (or /proc/PID/task/TID/stat) file after the command name: [0] is the state
    (field 3 of proc(5)), [16] the niceness (field 19)."""
    return Path(stat_file).read_text().rsplit(")", 1)[1].split()


def process_state(pid: int) -> str:
    """The one-letter state of `pid` (R running, S sleeping, T stopped by a signal, Z zombie)."""
    return stat_fields(f"/proc/{pid}/stat")[0]


def wait_until(condition, timeout: float = 60.0, what: str = "") -> None:
    """Poll `condition` until it holds; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
