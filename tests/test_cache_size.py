"""The last-level cache the format probe sizes itself by (engine/measure/cache.py): sysfs's report, or the smaller
size from which this machine already re-reads a buffer at memory speed (a VM may report its host socket's)."""
import pytest

from engine.measure import cache

MiB = 1 << 20


def machine_with(cache_bytes: int, memory: float = 25e9, fast: float = 55e9, outliers=()):
    """A warm-read rate for a machine keeping `cache_bytes`: the cache's speed below it, memory's from twice it, and
    between the two halfway (a buffer partly held); a size in `outliers` reads at memory speed once, as noise."""
    calls = []

    def rate(nbytes: int) -> float:
        calls.append(nbytes)
        if nbytes in outliers:
            return memory
        if nbytes <= cache_bytes:
            return fast
        return (fast + memory) / 2 if nbytes < 2 * cache_bytes else memory
    return rate, calls


def test_a_vm_reporting_its_host_s_cache_gets_the_size_it_keeps():
    rate, calls = machine_with(96 * MiB)
    assert cache.cache_knee(480 * MiB, rate) == 192 * MiB  # 128 MiB read partly cached; memory speed from 192 on
    assert max(calls) == 960 * MiB and max(c for c in calls if c < 480 * MiB) == 384 * MiB  # the grid below sysfs


def test_an_honest_report_is_kept():
    rate, _ = machine_with(32 * MiB)
    assert cache.cache_knee(32 * MiB, rate) == 32 * MiB
    rate, _ = machine_with(48 * MiB)
    assert cache.cache_knee(48 * MiB, rate) == 48 * MiB


def test_one_slow_read_is_not_the_edge():
    rate, _ = machine_with(96 * MiB, outliers={48 * MiB})
    assert cache.cache_knee(480 * MiB, rate) == 192 * MiB


def test_reads_slowed_by_other_work_do_not_set_the_edge():
    rate, _ = machine_with(96 * MiB)
    for slowed in ({16 * MiB, 24 * MiB, 32 * MiB}, {960 * MiB}):  # small buffers (the edge would fall), memory's
        count = []

        def contended(nbytes, slowed=slowed):  # the first pass read while another thread took a core
            count.append(nbytes)
            return 12e9 if len(count) <= 12 and nbytes in slowed else rate(nbytes)
        assert cache.cache_knee(480 * MiB, contended, passes=1) != 192 * MiB, slowed
        count.clear()
        assert cache.cache_knee(480 * MiB, contended) == 192 * MiB, slowed  # the later passes' reads


def test_never_more_than_sysfs_reports_nor_learnt_from_a_measure_that_found_no_cache():
    rate, _ = machine_with(96 * MiB)
    assert cache.cache_knee(100 * MiB, rate) == 100 * MiB
    rate, _ = machine_with(1 * MiB)  # even 16 MiB at memory's speed: the cores were taken, the report stands
    assert cache.cache_knee(480 * MiB, rate) == 480 * MiB


def test_sysfs_s_largest_cache_is_the_report(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert cache.reported_cache(tmp_path) == 480 * MiB
    (tmp_path / "index3" / "size").write_text("64G\n")
    assert cache.reported_cache(tmp_path) == cache.LARGEST
    assert cache.reported_cache(tmp_path / "missing") == cache.FALLBACK


def test_measured_once_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(cache, "reported_cache", lambda: 480 * MiB)
    measured = []
    monkeypatch.setattr(cache, "cache_knee", lambda reported: measured.append(reported) or cache.GRID[7])
    monkeypatch.setattr(cache, "watch_cpu", _quiet)
    cache._effective.cache_clear()
    assert cache.effective_cache() == 384 * MiB and measured == [480 * MiB]  # twice the edge
    cache._effective.cache_clear()  # a new process: read back from disk, not measured
    assert cache.effective_cache() == 384 * MiB and measured == [480 * MiB]
    monkeypatch.setattr(cache, "reported_cache", lambda: 256 * MiB)  # another machine: measured for it
    cache._effective.cache_clear()
    assert cache.effective_cache() == 256 * MiB and measured == [480 * MiB, 256 * MiB]  # never above sysfs


def test_a_measure_taken_beside_other_work_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(cache, "reported_cache", lambda: 480 * MiB)
    measured = []
    monkeypatch.setattr(cache, "cache_knee", lambda reported: measured.append(reported) or cache.GRID[0])
    monkeypatch.setattr(cache, "watch_cpu", _busy)
    assert cache.effective_cache() == 2 * cache.GRID[0]  # serves this process
    cache._effective.cache_clear()
    monkeypatch.setattr(cache, "watch_cpu", _quiet)
    monkeypatch.setattr(cache, "cache_knee", lambda reported: measured.append(reported) or cache.GRID[7])
    assert cache.effective_cache() == 384 * MiB and len(measured) == 2  # the next process measures again


def test_this_machine_s_measure_is_within_its_report():
    reported = cache.reported_cache()
    assert min(cache.GRID[0], reported) <= cache.effective_cache() <= reported


class _quiet:
    disturbed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _busy(_quiet):
    disturbed = True


@pytest.fixture(autouse=True)
def _fresh_memo():
    cache._effective.cache_clear()
    yield
    cache._effective.cache_clear()
