"""Huge pages under the CPU KV pool: the advice, the report of what the kernel gave, the switch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from herald.env import parse, reload_settings
from herald.kv.cpu_pool import CpuKVPool
from herald.kv.hugepages import HUGE_PAGE, advise_pages, anon_huge_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    """Transparent huge pages are 'always' or 'madvise' here (the advice can be taken)."""
    try:
        text = THP.read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def test_the_switch_is_off_unless_turned_on() -> None:
    assert parse({}).huge_pages is False
    assert parse({"HERALD_HUGE_PAGES": "1"}).huge_pages is True
    assert parse({"HERALD_HUGE_PAGES": "0"}).huge_pages is False
    assert parse({"HERALD_HUGE_PAGES": "on"}).huge_pages is True
    with pytest.raises(ValueError, match="HERALD_HUGE_PAGES='maybe'"):
        parse({"HERALD_HUGE_PAGES": "maybe"})


def test_no_whole_huge_page_no_advice() -> None:
    for huge in (True, False):
        assert advise_pages(HUGE_PAGE + 4096, HUGE_PAGE, huge=huge) is False  # holds none whole
        assert advise_pages(0, 0, huge=huge) is False


def test_anon_huge_bytes_reads_the_rollup(tmp_path: Path) -> None:
    f = tmp_path / "smaps_rollup"
    f.write_text("Rss:  100 kB\nAnonHugePages:    4096 kB\nShmemHugePages: 0 kB\n")
    assert anon_huge_bytes(f) == 4096 * 1024
    f.write_text("Rss:  100 kB\n")
    assert anon_huge_bytes(f) is None
    assert anon_huge_bytes(tmp_path / "missing") is None


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_pool_starts_on_a_huge_page_and_says_what_it_got(
    switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERALD_HUGE_PAGES", switch)
    reload_settings()
    pool = CpuKVPool(2, 2, 64, 32, 300, pin=False)  # 9.4 MiB: several huge pages
    try:
        assert pool.storage.data_ptr() % HUGE_PAGE == 0
        assert float(pool.storage.abs().sum()) == 0.0  # touched, zero
        if switch == "0":
            assert pool.huge_pages_advised is False
        elif sys.platform.startswith("linux") and _thp_on():
            assert pool.huge_pages_advised is True  # (with THP 'never' the advice may go unheeded)
        line = pool.describe()
        assert (
            ("on 2 MiB pages" in line)
            or ("2 MiB pages asked for" in line)
            or ("4 KiB pages" in line)
        )
        if switch == "0" and not pool.huge_page_bytes:
            assert line.endswith("; 4 KiB pages")
    finally:
        pool.close()


@pytest.mark.parametrize(("switch", "huge"), [("1", True), ("0", False), ("", False)])
def test_the_pool_asks_for_the_pages_the_switch_names(
    switch: str, huge: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off (the default) is an explicit request for 4 KiB pages, so a host whose transparent
    huge pages are 'always' does not put the pool on 2 MiB pages anyway."""
    import herald.kv.cpu_pool as cpu_pool

    asked: list[bool] = []

    def record(addr: int, nbytes: int, *, huge: bool) -> bool:
        asked.append(huge)
        return True

    monkeypatch.setattr(cpu_pool, "advise_pages", record)
    monkeypatch.setenv("HERALD_HUGE_PAGES", switch)
    reload_settings()
    try:
        pool = CpuKVPool(2, 2, 64, 32, 300, pin=False)
        pool.close()
    finally:
        monkeypatch.undo()
        reload_settings()
    assert asked == [huge]
    assert pool.huge_pages_advised is huge
