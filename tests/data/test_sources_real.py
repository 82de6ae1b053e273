"""Packaged real data sets (openclipart, material_icons): real pairs with captions, stable keys,
disjoint fit / val / test splits whose union is everything kept, deterministic order, and
`vlp shards <source> OUT` shards that the stream reads back.

The data come from Debian packages (scripts/setup.sh installs them when run as root). Without them
the data tests skip with the reason; under CI=true that skip is a failure."""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlp.cli import main
from vlp.data.embedded import embedded_source, prepare_shards
from vlp.data.sources import PACKAGED, packaged_source, parse_packaged
from vlp.data.sources import material_icons, openclipart
from vlp.data.sources.cached import MissingPackage, read_index
from vlp.data.sources.openmoji import split_of
from loaders import make_loader
from dp_helpers import to_tensor, tokenize

SOURCES = ("openclipart", "material_icons")
PX = 32  # small renders keep the session's one-time render short
MIN_PAIRS = {"openclipart": 2000, "material_icons": 1800}


def require_installed(name: str) -> None:
    """Skip (fail under CI=true) when the Debian package of ``name`` is not installed."""
    module = packaged_source(name)
    paths = (module.ROOT / "svg", module.ROOT / "png") if name == "openclipart" else \
        (module.FONT, module.CODEPOINTS)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        reason = (f"{name}: {', '.join(missing)} missing: `apt-get install -y {' '.join(module.PACKAGES)}` "
                  "(scripts/setup.sh does it as root)")
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the packaged data tests: " + reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    """A private $VLP_CACHE: <root>/<source name> is each source's cache (as the CLI finds it)."""
    return tmp_path_factory.mktemp("packaged-cache")


@pytest.fixture(scope="session", params=SOURCES)
def source(request, cache_root):
    """(name, module, its 'all' pairs) rendered once per session at PX px into a private cache."""
    require_installed(request.param)
    module = packaged_source(request.param)
    return request.param, module, module.load_pairs("all", image_size=PX, cache_dir=cache_root / request.param)


@pytest.fixture
def real_cache(source, cache_root, monkeypatch) -> Path:
    """The source's cache folder; $VLP_CACHE points the CLI and prepare_shards at it too."""
    monkeypatch.setenv("VLP_CACHE", str(cache_root))
    return cache_root / source[0]


def test_pairs_have_captions_keys_and_images(source):
    name, _, pairs = source
    assert len(pairs) >= MIN_PAIRS[name]
    keys = [p.key for p in pairs]
    assert len(set(keys)) == len(keys)
    captions = [p.caption for p in pairs]
    assert len(set(captions)) == len(captions)  # one pair per caption: retrieval is unambiguous
    assert all(p.caption.strip() == p.caption and p.meta["name"] in p.caption for p in pairs)
    assert all(len(p.caption) <= 200 for p in pairs)
    for pair in pairs[:: max(1, len(pairs) // 200)]:
        pixels = np.asarray(Image.open(io.BytesIO(pair.image)))
        assert pixels.shape == (PX, PX, 3), pair.key
        assert pixels.min() < 255 and pixels.std() > 0, pair.key  # something drawn on white


def test_splits_disjoint_and_cover_everything(source, real_cache):
    name, module, pairs = source
    split = {s: module.load_pairs(s, image_size=PX, cache_dir=real_cache) for s in
             ("fit", "val", "test", "train", "eval")}
    keys = {s: [p.key for p in split[s]] for s in split}
    for a, b in (("fit", "val"), ("fit", "test"), ("val", "test")):
        assert not set(keys[a]) & set(keys[b])
        assert not {p.caption for p in split[a]} & {p.caption for p in split[b]}
        assert not {p.meta["name"] for p in split[a]} & {p.meta["name"] for p in split[b]}
    everything = [p.key for p in pairs]
    assert sorted(keys["fit"] + keys["val"] + keys["test"]) == sorted(everything)
    assert sorted(keys["train"]) == sorted(keys["fit"] + keys["val"]) and keys["eval"] == keys["test"]
    # each split keeps the order of 'all', and the split is the name's hash (as OpenMoji's)
    for s in ("fit", "val", "test"):
        assert keys[s] == [k for k in everything if k in set(keys[s])]
    assert all(p.meta["split"] == split_of(p.meta["name"]) for p in pairs)
    for s in ("val", "test"):
        assert 0.06 < len(split[s]) / len(pairs) < 0.14, (name, s, len(split[s]))


def test_deterministic_from_cache_and_from_the_files(source, real_cache):
    name, module, pairs = source
    again = module.load_pairs("all", image_size=PX, cache_dir=real_cache)
    assert [(p.key, p.caption, p.image) for p in again] == [(p.key, p.caption, p.image) for p in pairs]
    if name == "material_icons":  # a second render is cheap: identical keys, captions and pixels
        directory = real_cache / "fresh"
        fresh = module.load_pairs("all", image_size=PX, cache_dir=directory)
        assert [(p.key, p.caption, p.image) for p in fresh] == [(p.key, p.caption, p.image) for p in pairs]
    else:  # the kept rows are a function of the installed files (their order too)
        rows, _ = openclipart.drawings(openclipart.ROOT)
        kept = {p.key for p in pairs}
        listed = [r["key"] for r in openclipart.captioned(rows, Counter())]
        assert [k for k in listed if k in kept] == [p.key for p in pairs]


def test_skips_are_counted(source, real_cache):
    name, module, pairs = source
    index = read_index(module.ensure_rendered(PX, real_cache))
    assert len(index["pairs"]) == len(pairs)
    if name == "openclipart":
        skipped = index["skipped"]
        # the same SVG under several category folders is one drawing; titles of collections go
        assert skipped["duplicate_file"] > 0 and skipped["collection_title"] > 0
        assert skipped["too_large"] > 0 and "unreadable_png" not in skipped  # posters of 170 Mpx
        assert len({p.meta["sha1"] for p in pairs}) == len(pairs)
    else:
        assert index["skipped"].get("alias", 0) > 0  # 'alarm' and 'access_alarm' draw one glyph


def test_vlp_shards_writes_readable_shards(source, real_cache, tmp_path):
    name, module, _ = source
    out = tmp_path / "val"
    assert main(["shards", f"{name}:{PX}", str(out), "--split", "val", "--samples-per-shard", "100"]) == 0
    val = module.load_pairs("val", image_size=PX, cache_dir=real_cache)
    sizes = json.loads((out / "sizes.json").read_text())
    assert sum(sizes.values()) == len(val) and len(sizes) == -(-len(val) // 100)
    loader = make_loader(str(out) + "/shard-{000000..%06d}.tar" % (len(sizes) - 1), batch_size=8,
                         transform=to_tensor, tokenize=tokenize, mode="sequential", drop_last=False)
    batches = list(loader)
    assert [k for b in batches for k in b["key"]] == [p.key for p in val]
    assert batches[0]["image"].shape[1:] == (3, PX, PX)
    assert not any(b["skipped"] for b in batches)


def test_study_shards_of_a_packaged_source(source, real_cache, tmp_path):
    """embedded_source + prepare_shards: what `vlp compare` resolves 'material_icons:32' to."""
    name, module, pairs = source
    assert embedded_source(f"{name}:{PX}") == (name, PX)
    specs = prepare_shards(tmp_path / "study", ("fit", "val", "test"), PX, source=name)
    counted = {s: sum(json.loads((tmp_path / "study" / s / "sizes.json").read_text()).values()) for s in specs}
    assert sum(counted.values()) == len(pairs) and min(counted.values()) > 100


# ------------------------------------------------------------------ pure parts (no package needed)
def test_specs_name_a_packaged_source_a_size_or_a_split():
    assert set(SOURCES) <= set(PACKAGED)
    assert parse_packaged("openclipart") == ("openclipart", None, None)
    assert parse_packaged("material_icons:128") == ("material_icons", 128, None)
    assert parse_packaged("openmoji:eval") == ("openmoji", None, "eval")
    assert parse_packaged("data/shard-{000000..000003}.tar") is None
    assert embedded_source("") == ("openmoji", 64) and embedded_source("openclipart") == ("openclipart", 64)
    for bad in ("openclipart:8", "openclipart:1024", "material_icons:big"):
        with pytest.raises(ValueError, match="render size in 16..512"):
            parse_packaged(bad)
    with pytest.raises(ValueError, match="splits are chosen by the run"):
        embedded_source("openclipart:fit")


SVG = """<svg xmlns="http://www.w3.org/2000/svg" xmlns:dc="http://purl.org/dc/elements/1.1/"
 xmlns:cc="http://web.resource.org/cc/" xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">
<metadata><rdf:RDF><cc:Work rdf:about=""><dc:title>  Red_Lips
 </dc:title><dc:description>{desc}</dc:description><dc:creator><cc:Agent><dc:title>Some Author</dc:title>
</cc:Agent></dc:creator></cc:Work></rdf:RDF></metadata><title>svg title</title></svg>"""


def test_svg_titles_and_captions():
    assert openclipart.svg_metadata(SVG.format(desc="Red female lips").encode()) == ("Red Lips", "Red female lips")
    no_work = '<svg xmlns="http://www.w3.org/2000/svg"><title>A  boat</title></svg>'
    assert openclipart.svg_metadata(no_work.encode()) == ("A boat", "")
    assert openclipart.caption_for("Red Lips", "Red female lips") == "clip art of Red Lips: Red female lips"
    for junk in ("me@example.org", "EPS converted from http://aiga.org", "Made with Sodipodi", "red lips",
                 "x" * 101, "lips"):
        assert openclipart.caption_for("Red Lips", junk) == "clip art of Red Lips"
    assert openclipart.clean("a " * 100, 20) == "a a a a a a a a a a"
    title, _ = openclipart.svg_metadata(SVG.replace("Red_Lips", "Clipart by Nicu Buculei - smiley 3").encode())
    assert title == "smiley 3"


def test_collection_titles_and_repeated_titles_are_skipped_and_counted():
    rows = [{"sha1": f"{i:040x}", "path": f"cat/item{i}.svg", "category": "cat", "title": t, "description": ""}
            for i, t in enumerate(["Theme"] * 4 + ["Boat", "boat", "Car"])]
    skipped = Counter()
    kept = openclipart.captioned(rows, skipped)
    assert [r["caption"] for r in kept] == ["clip art of Boat", "clip art of Car"]
    assert skipped == {"collection_title": 4, "duplicate_title": 1}
    assert kept[0]["key"] == "oca_item4_" + "0" * 8


def test_icon_names_read_as_words(tmp_path):
    scss = tmp_path / "_variables.scss"
    scss.write_text('$x: map-merge((\n\t"beach_access": eb3e,\n\t"10k": e951,\n\t"ac_unit": eb3b,\n), $x);\n')
    assert material_icons.read_codepoints(scss) == [("10k", 0xE951), ("ac_unit", 0xEB3B), ("beach_access", 0xEB3E)]
    assert material_icons.words("beach_access") == "beach access"
    assert material_icons.caption_for("beach_access") in [t.format(name="beach access")
                                                          for t in material_icons.TEMPLATES]
    (tmp_path / "empty.scss").write_text("nothing here")
    with pytest.raises(ValueError, match="no icon names"):
        material_icons.read_codepoints(tmp_path / "empty.scss")


def test_missing_package_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(openclipart, "ROOT", tmp_path / "nothing")
    with pytest.raises(MissingPackage, match="apt-get install -y openclipart-svg openclipart-png"):
        openclipart.load_pairs("fit", cache_dir=tmp_path)
    assert main(["shards", "openclipart", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlp: error: openclipart:") and "apt-get install" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_missing_package_skips_but_fails_under_ci(tmp_path, monkeypatch):
    monkeypatch.setattr(openclipart, "ROOT", tmp_path / "nothing")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y openclipart-svg openclipart-png"):
        require_installed("openclipart")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="openclipart"):
        require_installed("openclipart")
