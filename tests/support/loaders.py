"""make_loader as the tests call it: the shard spec and DataConfig's fields as keywords
(batch_size for data.batch_per_device), the rest as vlp.data.stream.make_loader takes them."""
from vlp.config.keys import DataConfig
from vlp.data import stream

FIELDS = {"batch_size": "batch_per_device", "num_workers": "num_workers", "mode": "mode",
          "shuffle_buffer": "shuffle_buffer", "num_samples": "num_samples", "weights": "weights",
          "decode_size": "decode_size", "io_retries": "io_retries", "io_backoff_s": "io_backoff_s"}


def make_loader(urls: str, *, batch_size: int, **kw):
    """vlp.data.stream.make_loader(DataConfig(train_shards=urls, ...), **the rest)."""
    fields = {FIELDS[k]: kw.pop(k) for k in list(kw) if k in FIELDS}
    return stream.make_loader(DataConfig(train_shards=urls, batch_per_device=batch_size, **fields), **kw)
