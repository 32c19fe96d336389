"""What /proc says of a process, for tests that watch real processes."""


def process_state(pid: int) -> str:
    """The one-letter state of `pid` (R running, S sleeping, T stopped by a signal, Z zombie)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
