"""The dataset settings: what a ``dataset`` (or ``eval_dataset``) value may be, and the object it
becomes on the driver and on each worker.

A dataset is a map-style dataset of (input, target) pairs, a zero-argument factory of one, an
import string or ``{target: ..., **kwargs}``, or a Parquet URI (``*.parquet``,
``parquet://...``, or a directory given with ``dataset_format: parquet``). A local Parquet path
that does not exist is a ``ConfigError`` saying "not found", before any worker starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from elastic.checkpoint.location import local_path
from elastic.errors import ConfigError

from .code import check_code, resolve_callable

__all__ = ["is_parquet", "is_ray_dataset", "parquet_uri", "check_dataset", "dataset_object"]

DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def is_parquet(spec: Any, fmt: str | None) -> bool:
    """Whether the dataset setting ``spec`` names Parquet data."""
    return isinstance(spec, str) and fmt != "ray" and (
        fmt == "parquet" or spec.endswith(".parquet") or spec.startswith("parquet://")
    )


def is_ray_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``ray.data.Dataset`` (told without importing Ray)."""
    return type(obj).__module__.startswith("ray.data") and hasattr(obj, "to_arrow_refs")


def parquet_uri(spec: str) -> str:
    """The pyarrow URI of a Parquet dataset setting (``parquet://`` removed)."""
    return spec[len("parquet://"):] if spec.startswith("parquet://") else spec


def check_dataset(spec: Any, field: str, fmt: str | None) -> None:
    """The form of a dataset setting (code named by it is imported; no data is read)."""
    if is_parquet(spec, fmt) or is_ray_dataset(spec):
        return
    if fmt == "ray" and not isinstance(spec, (str, Mapping)) and not callable(spec):
        raise ConfigError(field, f"{type(spec).__name__} is not a Ray dataset.",
                          "with dataset_format: ray, give a ray.data.Dataset or "
                          "'package.module:factory' of one")
    if isinstance(spec, str) and ":" not in spec:
        raise ConfigError(field, f"{spec!r} is neither a Parquet dataset nor an import string.",
                          "give a *.parquet file or directory (with dataset_format: parquet "
                          "for a directory), or 'package.module:factory'")
    if isinstance(spec, (str, Mapping)) or callable(spec):
        check_code(spec, field, complete=True)
        return
    if hasattr(spec, "__getitem__") and hasattr(spec, "__len__"):
        return
    raise ConfigError(
        field, f"{type(spec).__name__} is not a map-style dataset.",
        "pass an object with __len__ and __getitem__, a factory of one, or a Parquet URI",
    )


def dataset_object(spec: Any, field: str, fmt: str | None, input_column: str,
                   target_column: str, input_dtype: str = "float32",
                   target_dtype: str = "float32") -> Any:
    """The dataset a setting names (a ``ParquetDataset``, the object, or what its factory
    returns). Raises ``ConfigError`` if a local Parquet path does not exist or the code
    cannot be imported."""
    from elastic.data import ParquetDataset

    if is_parquet(spec, fmt):
        uri = parquet_uri(spec)
        _exists(uri, field)
        return ParquetDataset(uri, input_column, target_column, input_dtype, target_dtype)
    if is_ray_dataset(spec):
        return spec  # the controller runs it into blocks once Ray is up (elastic.ray_dataset)
    if isinstance(spec, (str, Mapping)):
        spec = resolve_callable(spec, field)
    if not isinstance(spec, type) and hasattr(spec, "__getitem__") and hasattr(spec, "__len__"):
        return spec
    if callable(spec):
        return spec()
    raise ConfigError(
        field, f"{type(spec).__name__} is not a map-style dataset.",
        "pass an object with __len__ and __getitem__, a factory of one, or a Parquet URI",
    )


def _exists(uri: str, field: str) -> None:
    """A local path (or ``file://``) must exist; remote URIs are left to pyarrow."""
    if urlsplit(uri).scheme not in ("", "file"):
        return
    try:
        path = local_path(uri)
    except ValueError as e:
        raise ConfigError(field, f"{e.args[0]}.", e.args[1]) from None
    if not os.path.exists(os.path.expanduser(path)):
        shown = os.path.abspath(os.path.expanduser(path))
        raise ConfigError(field, f"{uri} not found ({shown} does not exist).",
                          "check the path; a relative path is read from the directory the job "
                          f"starts in ({os.getcwd()})")
