"""vlp.data.tars reads plain ustar/GNU headers itself and hands every other header to tarfile:
the samples and skip counts are tarfile's for pax and GNU long names, directories, prefixes,
global pax headers and truncation."""

import io
import tarfile
from collections import Counter

import pytest

from vlp.data import tars
from vlp.data.tars import read_shard


def write(path, names, fmt, global_pax=False, dirs=False):
    with tarfile.open(path, "w", format=fmt, **({"pax_headers": {"comment": "x"}} if global_pax else {})) as tar:
        if dirs:
            info = tarfile.TarInfo("d/")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for i, name in enumerate(names):
            for ext, data in (("jpg", bytes([i]) * (100 + 37 * i)), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def read_with(path, plain: bool, monkeypatch, **kwargs):
    if not plain:
        monkeypatch.setattr(tars, "_plain_header", lambda tar: None)
    skipped = Counter()
    out = list(read_shard(str(path), 0, None, skipped, **kwargs))
    monkeypatch.undo()
    return out, skipped


NAMES = {
    "short": [f"k{i:03d}" for i in range(6)],
    "prefix": [("p" * 90) + f"/dir/k{i}" for i in range(4)],  # > 100 chars: ustar prefix or long-name
    "unicode": [f"caf\u00e9_{i}" for i in range(4)],              # pax path record (PAX), raw utf-8 (GNU)
    "long": [("n" * 130) + f"_{i}" for i in range(3)],          # pax / GNU long name
}


FORMATS = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]
CASES = [(fmt, names, extra) for fmt in FORMATS for names in NAMES for extra in ("", "dirs", "global_pax")
         if not (fmt == tarfile.USTAR_FORMAT and names == "long")]  # ustar cannot hold a 130-char name


@pytest.mark.parametrize("fmt,names,extra", CASES)
def test_same_samples_as_tarfile(tmp_path, monkeypatch, fmt, names, extra):
    path = tmp_path / "s.tar"
    write(path, NAMES[names], fmt, global_pax=extra == "global_pax" and fmt == tarfile.PAX_FORMAT,
          dirs=extra == "dirs")
    plain = []
    original = tars._plain_header
    monkeypatch.setattr(tars, "_plain_header", lambda tar: plain.append(original(tar)) or plain[-1])
    fast = read_with(path, True, monkeypatch)
    assert fast == read_with(path, False, monkeypatch)
    assert len(fast[0]) == len(NAMES[names]) and not fast[1]
    if names == "short" and extra != "global_pax":  # plain headers: read without tarfile
        assert sum(m is not None for m in plain) >= 2 * len(NAMES[names]) - 1
    wanted = read_with(path, True, monkeypatch, want=lambda i: i % 2 == 1)
    assert wanted == read_with(path, False, monkeypatch, want=lambda i: i % 2 == 1)


@pytest.mark.parametrize("cut", [512 + 50, 1024 + 10, 2048, 2600, 3584, -1024, -700])
def test_truncated_shards_count_as_tarfile_does(tmp_path, monkeypatch, cut):
    path = tmp_path / "s.tar"
    write(path, NAMES["short"], tarfile.GNU_FORMAT)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    assert read_with(path, True, monkeypatch) == read_with(path, False, monkeypatch)


def test_a_bad_checksum_is_tarfiles_to_judge(tmp_path, monkeypatch):
    path = tmp_path / "s.tar"
    write(path, NAMES["short"], tarfile.GNU_FORMAT)
    data = bytearray(path.read_bytes())
    data[2048 + 10] ^= 0xFF  # the name of a later member's header
    path.write_bytes(bytes(data))
    fast = read_with(path, True, monkeypatch)
    assert fast == read_with(path, False, monkeypatch)
