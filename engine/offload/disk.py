"""The disk tier: one file per block in a folder, LRU within a byte budget, read again after a
restart.

A file is data from outside the process, so it says what made it and proves it is whole:

    <digest hex>.kv:  MAGIC (8 bytes) | header length (u32 LE) | header (JSON) | record (block_bytes)
    header: identity (fingerprint of the model's files and of everything else that decides the
            stored bits: dtypes, block size, pool layout, smoothing, device kind), the readable
            model / dtype / kv_cache_dtype / block_size, the block's digest and token ids, and the
            BLAKE2b checksum of the record

At start the folder is scanned (headers only): a file of another identity is skipped with a
warning and left alone (another server may own it), an unreadable one is skipped and removed. A
record whose checksum fails when it is read is a miss, with a warning, and its file goes. Reads and
writes run on a worker thread of their own; a write that fails (disk full, folder gone) is a
warning, and the server goes on with the tiers it has.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
import torch

from ..errors import StartupError
from .copier import Transfer

log = structlog.get_logger(__name__)

MAGIC = b"PIEKV\x00\x01\n"  # format version 1
SUFFIX = ".kv"
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class DiskIdentity:
    """What a file must have been made by to be served."""

    fingerprint: str  # hex digest of the model's files and the fields below (model_fingerprint)
    model: str  # the model folder's name (for the warnings)
    dtype: str  # weights / activations
    kv_cache_dtype: str
    block_size: int
    block_bytes: int  # one record's bytes


def model_fingerprint(model_dir: str, **facts: object) -> str:
    """A digest of the model folder's config and weight files (each file's name, size, first MiB
    and eight 64 KiB windows spread over it: a fine-tune of the same shapes differs there), and
    of `facts` (dtypes, block size, pool layout, ...): what decides a block's stored bits."""
    h = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16)
    folder = Path(model_dir)
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".json", ".safetensors", ".bin")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        if path.suffix == ".json":
            h.update(path.read_bytes())
            continue
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            for i in range(8):
                f.seek(size * i // 8)
                h.update(f.read(1 << 16))
    return h.hexdigest()


def check_disk(directory: str, capacity_bytes: int, held: int | None) -> None:
    """StartupError unless `directory` can be made and written and its disk has room for
    `capacity_bytes` (counting `held` bytes of blocks already there as room; None: every block
    file there, whoever made it)."""
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"pie")
        probe.unlink()
    except OSError as e:
        raise StartupError(f"--kv-disk-dir {directory}: cannot write there ({e.strerror or e}); give a folder this "
                           "user can write") from e
    if held is None:
        held = sum(p.stat().st_size for p in folder.glob("*" + SUFFIX))
    free = shutil.disk_usage(folder).free
    if free + held < capacity_bytes:
        raise StartupError(f"--kv-disk-gib {capacity_bytes / 2**30:.3g}: {directory} has {free / 2**30:.3g} GiB free "
                           f"(and {held / 2**30:.3g} GiB of blocks there): lower --kv-disk-gib or free the disk")


class DiskTier:
    def __init__(self, directory: str, capacity_bytes: int, identity: DiskIdentity, host_rows: torch.Tensor) -> None:
        self.dir = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.rows = host_rows
        self._header = asdict(identity)
        check_disk(directory, capacity_bytes, held=None)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # digest -> file bytes, least recently used first
        self.used_bytes = 0
        self._scan()
        check_disk(directory, capacity_bytes, held=self.used_bytes)
        self._evict()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._index

    def path(self, digest: bytes) -> Path:
        return self.dir / (digest.hex() + SUFFIX)

    # ---- the index (engine thread) ---------------------------------------------------------------
    def _scan(self) -> None:
        """Indexes the files of this identity, oldest first; warns of the others."""
        found, foreign, broken = [], [], []
        for path in self.dir.glob("*" + SUFFIX):
            try:
                header, size = _read_header(path)
                digest = bytes.fromhex(path.stem)
            except (OSError, ValueError) as e:
                broken.append((path, str(e)))
                continue
            if any(header.get(k) != v for k, v in self._header.items()) or header.get("digest") != path.stem:
                foreign.append(path)
                continue
            found.append((path.stat().st_mtime, digest, size))
        if foreign:
            log.warning("kv_disk_files_skipped", dir=str(self.dir), files=len(foreign), example=str(foreign[0]),
                        reason="made by another model, dtype, block size or pool layout: never served")
        for path, error in broken:
            log.warning("kv_disk_file_corrupt", path=str(path), error=error, action="removed")
            path.unlink(missing_ok=True)
        for _, digest, size in sorted(found):
            self._index[digest] = size
            self.used_bytes += size
        log.info("kv_disk_scanned", dir=str(self.dir), blocks=len(found), gib=round(self.used_bytes / 2**30, 3))

    def touch(self, digest: bytes) -> None:
        self._index.move_to_end(digest)

    def added(self, digest: bytes, size: int) -> None:
        """A write landed: index it (most recently used) and evict past the budget."""
        if digest not in self._index:
            self._index[digest] = size
            self.used_bytes += size
        self._evict()

    def _evict(self) -> None:
        while self.used_bytes > self.capacity_bytes and self._index:
            digest, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self._submit_unlink(digest)

    def discard(self, digest: bytes) -> None:
        """Forget a block (its file failed a read): the file goes."""
        size = self._index.pop(digest, None)
        if size is not None:
            self.used_bytes -= size
            self._submit_unlink(digest)

    def clear(self) -> int:
        """Removes every file of the index; returns how many."""
        n = len(self._index)
        for digest in list(self._index):
            self.discard(digest)
        return n

    def _submit_unlink(self, digest: bytes) -> None:
        path = self.path(digest)
        if hasattr(self, "_io"):
            self._io.submit(path.unlink, missing_ok=True)
        else:
            path.unlink(missing_ok=True)

    # ---- I/O (on the worker) ---------------------------------------------------------------------
    def write(self, digest: bytes, tokens: tuple[int, ...], slot: int, filling: Transfer | None) -> Future[int]:
        """Writes host row `slot` (once `filling` landed) as the file of `digest`; the future
        gives the file's size, or raises OSError."""
        return self._io.submit(self._write, digest, tokens, slot, filling)

    def _write(self, digest: bytes, tokens: tuple[int, ...], slot: int, filling: Transfer | None) -> int:
        if filling is not None:
            filling.wait()
        record = memoryview(self.rows[slot].numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
        header = json.dumps({**self._header, "digest": digest.hex(), "tokens": list(tokens),
                             "checksum": hashlib.blake2b(record, digest_size=16).hexdigest()}).encode()
        path = self.path(digest)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(record)
            os.replace(tmp, path)  # whole or absent, never half written
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return len(MAGIC) + _LEN.size + len(header) + len(record)

    def read(self, digest: bytes, tokens: tuple[int, ...], slot: int) -> Future[bool]:
        """Reads the file of `digest` into host row `slot`; the future gives False (and a warning
        was logged) when the file is gone, is not that block, or fails its checksum."""
        return self._io.submit(self._read, digest, tokens, slot)

    def _read(self, digest: bytes, tokens: tuple[int, ...], slot: int) -> bool:
        path = self.path(digest)
        try:
            header, _ = _read_header(path)
            if header.get("digest") != digest.hex() or tuple(header.get("tokens", ())) != tokens:
                raise ValueError("it holds another block")
            row = self.rows[slot].numpy()
            with open(path, "rb") as f:
                f.seek(len(MAGIC) + _LEN.size + header["_header_len"])
                if f.readinto(memoryview(row)) != row.nbytes or f.read(1):  # type: ignore[arg-type]
                    raise ValueError("its record has the wrong length")
            if hashlib.blake2b(row.data, digest_size=16).hexdigest() != header.get("checksum"):
                raise ValueError("its checksum does not match its record")
        except (OSError, ValueError) as e:
            log.warning("kv_disk_read_failed", path=str(path), error=str(e), action="a miss; the file is removed")
            path.unlink(missing_ok=True)
            return False
        return True

    def close(self) -> None:
        self._io.shutdown(wait=True)


def _read_header(path: Path) -> tuple[dict, int]:
    """A file's header (with `_header_len`) and its size; ValueError when it is not one of ours."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + _LEN.size)
        if len(head) != len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
            raise ValueError("not a pie KV block file (magic)")
        (n,) = _LEN.unpack(head[len(MAGIC):])
        if n > 1 << 24:
            raise ValueError("header too long")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"unreadable header ({e})") from e
    if not isinstance(header, dict):
        raise ValueError("unreadable header")
    size = path.stat().st_size
    if size != len(MAGIC) + _LEN.size + n + header.get("block_bytes", -1):
        raise ValueError("truncated: its size does not match its header")
    header["_header_len"] = n
    return header, size
