"""A job's files, either mode: what `upload` reads and names, how a download is checked."""
from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Optional, Union

from . import protocol
from .errors import SandqError
from .types import Artifact, InputFile

Source = Union[str, os.PathLike, bytes]


def read_source(source: Source) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    return Path(source).read_bytes()


def work_path(source: Source, path: Optional[str]) -> str:
    """Where the job sees an upload, under `/work`: `path`, else the file's name (bytes need one)."""
    if path is not None:
        return path
    if isinstance(source, (bytes, bytearray, memoryview)):
        raise ValueError("give the path inside /work for bytes")
    return Path(source).name


def input_file(data: bytes, path: str) -> InputFile:
    """The `InputFile` of stored bytes: its content address (`protocol.input_key`) and `path`."""
    digest = protocol.sha256_hex(data)
    return InputFile(key=protocol.input_key(digest), path=path, size=len(data), sha256=digest)


def fetch_url(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (a presigned http(s) URL)
        return response.read()


def check_download(artifact: Artifact, data: bytes) -> bytes:
    if len(data) != artifact.size or protocol.sha256_hex(data) != artifact.sha256:
        raise SandqError(f"artifact {artifact.path}: downloaded {len(data)} bytes that do not match its size or sha256")
    return data


def target_of(artifact: Artifact, dest: Union[str, os.PathLike]) -> Path:
    """Where `download_to` writes: `dest`, or the artifact's name in it when it is a directory."""
    target = Path(dest)
    return target / Path(artifact.path).name if target.is_dir() else target
