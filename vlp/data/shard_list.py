"""Shard lists and sizes: a shard spec ('a-{000..009}.tar::b/', globs, directories, URLs,
pipe: commands) expanded to paths, and the samples per shard from metadata (sizes.json,
img2dataset stats) or, for local tars only, from their headers (vlp.data.tars)."""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile

from vlp.data.shard_io import Retry, ShardReadError, read_many, read_small
from vlp.locations import PIPE, has_backend, is_streamed, is_url
from vlp.data.tars import describe_unreadable, read_head, split_name


class SizesFetchError(ConnectionError, ValueError):
    """A remote sizes.json (or *_stats.json) that could not be fetched after data.io_retries:
    the server is down or unreachable. Names the URL. A ValueError too, so that `vlp` reports
    it as one line."""


# Per-directory metadata read while building one loader: {directory: {shard name: samples}}
# (sizes.json, {} where there is none) and {("ls", directory): set of names}. expand_sources
# and shard_sizes share one (make_loader passes it), so that each directory's sizes.json is
# read or fetched once, whatever the number of shards in it.
Tables = dict

_RANGE = re.compile(r"^([^{}\\]*)\{(\d+)\.\.(\d+)\}([^{}\\]*)$")


def brace_expand(part: str) -> list[str]:
    """braceexpand's result, with a fast path for the common 'prefix{000000..231349}suffix'
    (one ascending numeric range: a list comprehension instead of a generator chain)."""
    m = _RANGE.match(part)
    if m:
        prefix, lo, hi, suffix = m.groups()
        if int(lo) <= int(hi):
            padded = any(s.startswith("0") for s in (lo, hi) if s != "0")
            width = max(len(lo), len(hi)) if padded else 0
            return [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
    import braceexpand

    return list(braceexpand.braceexpand(part))


def expand_sources(urls: str, *, retry: Retry = Retry(), tables: Tables | None = None
                   ) -> list[list[str]]:
    """'a-{0..3}.tar::b.tar' -> [[a-0.tar, .., a-3.tar], [b.tar]]; raises FileNotFoundError
    for a missing local path. A directory stands for the shards listed in its sizes.json (else
    its *.tar, sorted); a glob ('d/*.tar') for its sorted matches.

    Remote elements (fsspec URLs, ``pipe:`` commands; vlp.data.shard_io) are taken as
    written, not checked here (a missing one fails when read, as a 'bad_shard'); a URL ending in
    '/' stands for the shards its sizes.json lists. Remote globs are not expanded: use braces.

    Linear in the shards: a local shard is checked against its directory's listing (one
    listdir per directory; only names missing from it are stat'ed, so a dangling symlink
    listed there fails when read, as a 'bad_shard'). ``retry``: for a remote sizes.json;
    ``tables``: the per-directory cache to share with shard_sizes (Tables)."""
    tables = {} if tables is None else tables
    sources, missing = [], []
    for part in str(urls).split("::"):
        part = part.strip()
        if not part:
            continue
        paths = []
        for path in brace_expand(part):
            if is_streamed(path):
                paths += (_remote_dir(path, retry, tables) if path.endswith("/") and is_url(path)
                          else [path])
            elif _listed(path, tables):
                paths.append(path)
            elif os.path.isdir(path):
                names = list(_local_table(path, tables)) or sorted(glob.glob("*.tar", root_dir=path))
                paths += [os.path.join(path, n) for n in names]
            elif any(ch in path for ch in "*?["):
                matches = sorted(glob.glob(path))
                paths += matches
                missing += [] if matches else [path]
            elif not os.path.isfile(path):
                missing.append(path)
            else:
                paths.append(path)
        if not paths and not missing:
            raise FileNotFoundError(f"no shards in {part!r} (a directory without sizes.json or .tar files)")
        sources.append(paths)
    if missing:
        raise FileNotFoundError(f"{len(missing)} shard(s) not found: {', '.join(missing[:5])}"
                                + (" ..." if len(missing) > 5 else ""))
    if not sources:
        raise ValueError(f"empty shard spec {urls!r}")
    return sources


def _split(path: str) -> tuple[str, str]:
    """os.path.split for the common case (POSIX, 'dir/name'), a string op cheaper than it."""
    if os.altsep is None:
        directory, sep, name = path.rpartition(os.sep)
        if directory and not directory.endswith(os.sep):
            return directory, name
        if not sep:
            return "", name
    return os.path.split(path)


def _listed(path: str, tables: Tables) -> bool:
    """Whether a local path names a file-like entry of its directory's listing (cached per
    directory): a cheap existence check for many shards of one directory. False means
    'not known': the caller checks the slow way."""
    if not path.endswith(".tar"):
        return False
    directory, name = _split(path)
    key = ("ls", directory)
    names = tables.get(key)
    if names is None:
        try:
            names = set(os.listdir(directory or "."))
        except OSError:
            names = set()
        tables[key] = names
    return name in names


def _remote_dir(url: str, retry: Retry, tables: Tables) -> list[str]:
    table = _table(url.rstrip("/"), retry, tables)
    if not table:
        raise FileNotFoundError(f"{url}sizes.json not found: a remote directory needs a sizes.json "
                                "listing its shards (or give the shards with braces)")
    return [url + name for name in table]


def _local_table(directory: str, tables: Tables) -> dict[str, int]:
    key = os.path.abspath(directory)
    if key not in tables:
        tables[key] = _read_sizes(key)
    return tables[key]


def _table(directory: str, retry: Retry, tables: Tables) -> dict[str, int]:
    """The sizes.json of a directory (local path or remote URL), read once per ``tables``."""
    if not is_streamed(directory):
        return _local_table(directory, tables)
    if directory not in tables:
        tables[directory] = _remote_sizes(directory, retry)
    return tables[directory]


def _read_sizes(directory: str) -> dict[str, int]:
    path = os.path.join(directory, "sizes.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return _parse_sizes(json.load(f), path)


def _parse_sizes(data, where: str) -> dict[str, int]:
    if isinstance(data, dict) and all(type(v) is int for v in data.values()):
        return data  # JSON keys are strings: the common case needs no copy
    try:
        return {str(k): int(v) for k, v in data.items()}
    except (ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"{where} is not a {{shard name: samples}} map: {e}") from None


def _remote_sizes(directory: str, retry: Retry = Retry()) -> dict[str, int]:
    """{shard name: samples} of the sizes.json at a remote directory URL ({} if it has none).
    Fetched with ``retry`` (data.io_retries / io_backoff_s); a source that still fails raises
    SizesFetchError naming the URL."""
    url = f"{directory}/sizes.json"
    try:
        data = read_small(url, retry)
    except ShardReadError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        raise SizesFetchError(
            f"cannot fetch the shard sizes {url} (after data.io_retries={retry.retries}): "
            f"{type(cause).__name__}: {cause}") from None
    if data is None:
        return {}
    try:
        return _parse_sizes(json.loads(data), url)
    except ValueError as e:
        raise ValueError(f"{url} is not a {{shard name: samples}} map: {e}") from None


def _metadata_location(spec: str) -> tuple[str, str] | None:
    """(directory URL or path, shard file name) where a remote spec's sizes may be found: beside
    the URL, or beside the .tar named in a pipe: command ('pipe:aws s3 cp s3://b/0001.tar -'
    looks in s3://b/). None if a pipe command names no .tar."""
    if spec.startswith(PIPE):
        tars = [t for t in spec[len(PIPE):].split() if t.endswith(".tar")]
        if not tars or (is_url(tars[0]) and not has_backend(tars[0])):
            return None  # e.g. no s3fs beside the aws CLI: sizes from data.num_samples
        spec = tars[0]
    if "/" not in spec:
        return ".", spec
    directory, _, name = spec.rpartition("/")
    return directory, name


def shard_sizes(paths: list[str], num_samples: int | None = None, *, retry: Retry = Retry(),
                tables: Tables | None = None) -> list[int]:
    """Samples per shard, from metadata only for remote shards, in the order docs/data.md
    ("Sizes") gives: ``sizes.json`` beside the shards, img2dataset's ``<name>_stats.json``, for
    local shards a count from the tar headers, then ``num_samples`` shared equally (remainder to
    the first) by the shards still unknown: an assumption, not a count; layout, determinism,
    exact resume and equal per-rank batches still hold, as they depend on the sizes used.
    Sequential (eval) mode is then not "every sample once". Without any of these a remote shard
    raises a one-line ValueError saying which to provide.

    Each directory's sizes.json is read (remote: fetched, with ``retry``) once, cached in
    ``tables`` (Tables; shared with expand_sources by make_loader); one pass over the paths.
    """
    tables = {} if tables is None else tables
    sizes, stats_wanted = _sizes_from_tables(paths, retry, tables)
    for i, count in _stats_successes(stats_wanted, retry).items():
        sizes[i] = count
    return _share_unknown(sizes, paths, num_samples)


def _sizes_from_tables(paths: list[str], retry: Retry, tables: Tables
                       ) -> tuple[list[int | None], dict[int, str]]:
    """Each path's size from its directory's sizes.json (local shards missing there: counted);
    None for a remote shard not listed, with the img2dataset stats file to try {index: URL}."""
    sizes: list[int | None] = []
    stats_wanted: dict[int, str] = {}
    local_dirs: dict[str, dict[str, int]] = {}  # directory as written -> its table
    remote_dirs: dict[str, dict[str, int]] = {}
    for i, path in enumerate(paths):
        if not is_streamed(path):
            directory, name = _split(path)
            table = local_dirs.get(directory)
            if table is None:
                table = local_dirs[directory] = _local_table(directory or ".", tables)
            size = table.get(name)
            sizes.append(size if size is not None else _count_samples(path))
            continue
        where = _metadata_location(path)
        sizes.append(None)
        if where is None:
            continue
        directory, name = where
        table = remote_dirs.get(directory)
        if table is None:
            table = remote_dirs[directory] = _table(directory, retry, tables)
        if name in table:
            sizes[i] = table[name]
        else:
            stem = name[:-len(".tar")] if name.endswith(".tar") else name
            stats_wanted[i] = f"{directory}/{stem}_stats.json"
    return sizes, stats_wanted


def _share_unknown(sizes: list[int | None], paths: list[str], num_samples: int | None) -> list[int]:
    """`sizes` with the unknown ones sharing what is left of ``num_samples`` (remainder to the
    first); a one-line ValueError when there is none to share."""
    unknown = [i for i, s in enumerate(sizes) if s is None]
    if not unknown:
        return sizes
    if num_samples is None:
        raise ValueError(
            f"sizes of {len(unknown)} remote shard(s) unknown (e.g. {paths[unknown[0]]}): put a "
            "sizes.json ({\"shard.tar\": samples, ...}) beside the shards, keep img2dataset's "
            "*_stats.json beside them, or set data.num_samples (samples per epoch)")
    left = int(num_samples) - sum(s for s in sizes if s is not None)
    if left < len(unknown):
        raise ValueError(f"data.num_samples={num_samples} leaves {left} samples for "
                         f"{len(unknown)} shard(s) of unknown size")
    share, extra = divmod(left, len(unknown))
    for k, i in enumerate(unknown):
        sizes[i] = share + (1 if k < extra else 0)
    return sizes


def _stats_successes(wanted: dict[int, str], retry: Retry = Retry()) -> dict[int, int]:
    """{index: successes} from img2dataset stats files that exist (local or remote URLs; remote
    ones fetched concurrently per filesystem, one batch per directory's shards)."""
    found: dict[str, bytes | None] = {}
    remote = sorted({url for url in wanted.values() if is_url(url)})
    by_scheme: dict[str, list[str]] = {}
    for url in remote:
        by_scheme.setdefault(url.split("://", 1)[0], []).append(url)
    for urls in by_scheme.values():
        try:
            found.update(read_many(urls))
        except (ShardReadError, ImportError) as e:
            raise ValueError(f"reading img2dataset stats: {e}") from None
    out = {}
    for i, url in wanted.items():
        data = found[url] if url in found else read_small(url, retry)
        if data is None:
            continue
        try:
            out[i] = int(json.loads(data)["successes"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{url}: no integer 'successes' ({e})") from None
    return out


def sizes_from_spec(urls: str, num_samples: int | None = None) -> int:
    """Total samples of a (brace / '::') shard spec, from sizes.json (see shard_sizes)."""
    tables: Tables = {}
    paths = [p for src in expand_sources(urls, tables=tables) for p in src]
    return sum(shard_sizes(paths, num_samples, tables=tables))


def _count_samples(path: str) -> int:
    """Samples in a tar without sizes.json (headers only; stops at the first error). A file
    with no readable sample at all is an error naming the file and why (describe_unreadable):
    otherwise it would silently count 0 and appear in no count."""
    count, last = 0, None
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                prefix = split_name(info.name)[0]
                if info.isfile() and prefix != last:
                    count, last = count + 1, prefix
    except (OSError, tarfile.TarError, EOFError):
        if count == 0:
            raise ValueError(f"shard {path} is unreadable: {describe_unreadable(read_head(path))}") from None
    return count
