"""Tier files against a local attacker: a symlink or someone else's file planted at the region's or the
disk tier's name is refused (no KV byte lands where the attacker can read it), as is a directory others
may write into without the sticky bit; the positive control creates a private 0600 file."""

from __future__ import annotations

import os
import stat

import pytest

from data_plane.disk import DiskTier
from data_plane.eviction import PolicyRegistry
from data_plane.files import UnsafeFile
from data_plane.shm import RegionBusy, SharedRegion

BLOCK = 4096


def region(path, owner=True):
    return SharedRegion(path, BLOCK, 4, owner=owner)


@pytest.fixture
def tier_dir(tmp_path):
    d = tmp_path / "tiers"
    d.mkdir(mode=0o700)
    return d


def test_a_fresh_region_is_a_private_file(tier_dir):
    r = region(tier_dir / "n.tier")
    try:
        st = os.stat(tier_dir / "n.tier")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        with pytest.raises(RegionBusy):  # a second owner of a live region is refused
            region(tier_dir / "n.tier")
    finally:
        r.close()


def test_a_planted_symlink_is_never_followed(tier_dir, tmp_path):
    loot = tmp_path / "attacker-readable"
    loot.write_bytes(b"")
    os.chmod(loot, 0o644)
    (tier_dir / "n.tier").symlink_to(loot)
    with pytest.raises(UnsafeFile, match="not a regular file"):
        region(tier_dir / "n.tier")
    assert loot.stat().st_size == 0  # nothing was written through the link
    registry = PolicyRegistry()
    (tier_dir / "n.disk").symlink_to(loot)
    with pytest.raises(UnsafeFile):
        DiskTier(tier_dir / "n.disk", BLOCK, 4, registry.create("lru", 4))
    assert loot.stat().st_size == 0


def test_a_file_readable_by_others_or_owned_by_another_user_is_refused(tier_dir):
    planted = tier_dir / "n.tier"
    planted.write_bytes(b"")
    os.chmod(planted, 0o644)
    with pytest.raises(UnsafeFile, match="others may read"):
        region(planted)
    if os.geteuid() == 0:
        os.chmod(planted, 0o600)
        os.chown(planted, 65534, 65534)  # nobody
        with pytest.raises(UnsafeFile, match="belongs to uid"):
            region(planted)


def test_a_stale_private_region_left_by_a_crash_is_replaced(tier_dir):
    stale = tier_dir / "n.tier"
    fd = os.open(stale, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, b"old bytes")
    os.close(fd)
    r = region(stale)
    try:
        assert bytes(r.slot(0)[:9]) == bytes(9)  # a new file, not the old one's bytes
    finally:
        r.close()


def test_a_directory_others_may_write_into_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeFile, match="not sticky"):
        region(shared / "n.tier")
    os.chmod(shared, 0o1777)  # like /dev/shm: others cannot rename or delete our file
    region(shared / "n.tier").close()
