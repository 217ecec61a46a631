"""The checkpoints section: where, how often, how many to keep, where to resume from.

The checkpoint URI and the resume URI are parsed here, once, into ``StorageLocation`` values
that travel with the config (to the workers too): no other code parses them again. The
secrets both carry (credentials in the URI or its query string, in ``checkpoint_options``, a
proxy's password) are collected here for ``JobConfig.redact``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elastic.checkpoint.location import (
    OWN_RESUMES,
    StorageLocation,
    collect_secrets,
    scrub,
    split_step_dir,
)
from elastic.errors import ConfigError

from .checks import did_you_mean, integer, mapping, number, text
from .sections import Section

__all__ = ["Checkpoints"]

def _remote(uri: str) -> bool:
    """Whether ``uri`` names an object store (s3://, gs://...), not a local path."""
    return "://" in uri and not uri.startswith("file://")




@dataclass(frozen=True)
class Checkpoints(Section):
    """``uri`` (default ``<run dir>/checkpoints``), ``every`` K steps (0: none periodic),
    ``options`` for the storage (``elastic.checkpoint.location``), retention (``keep_last``
    newest, plus every ``keep_every``-th step), ``wait_s`` a due checkpoint waits for the
    previous commit, ``upload_timeout_s`` one may take to upload and commit before it is
    given up (a storage call that never returns), ``resume``: ``latest`` or a checkpoint URI (a root, or one
    ``.../step-<n>`` directory).

    Derived when built: ``location`` (the parsed ``uri``, None when it is not given),
    ``resume_location``/``resume_step`` (the parsed ``resume`` URI) and ``secrets``.
    """

    NAME: ClassVar[str] = "checkpoints"
    FLAT: ClassVar[dict[str, str]] = {"uri": "checkpoint_uri", "every": "checkpoint_every",
                                      "options": "checkpoint_options",
                                      "wait_s": "checkpoint_wait_s",
                                      "upload_timeout_s": "checkpoint_upload_timeout_s"}

    uri: str | None = None
    every: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    keep_last: int = 3
    keep_every: int = 0
    wait_s: float = 30.0
    upload_timeout_s: float = 3600.0
    resume: str | None = None
    location: StorageLocation | None = field(default=None, init=False, repr=False,
                                             compare=False)
    resume_location: StorageLocation | None = field(default=None, init=False, repr=False,
                                                    compare=False)
    resume_step: int | None = field(default=None, init=False, repr=False, compare=False)
    secrets: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        options = mapping(self.options, "checkpoint_options",
                                 "e.g. checkpoint_options: {endpoint_override: "
                                 "http://minio:9000, region: us-east-1}")
        self._put("options", options)
        secrets = set(collect_secrets(self.uri if isinstance(self.uri, str) else None, options))
        if isinstance(self.resume, str) and self.resume not in OWN_RESUMES:
            secrets.update(collect_secrets(self.resume, options))
        self._put("secrets", tuple(sorted(secrets, key=len, reverse=True)))
        text(self.uri, "checkpoint_uri",
                    fix="give a local path, file://, s3:// or gs:// URI, or leave it out "
                        "(<run dir>/checkpoints)")
        integer(self.every, "checkpoint_every", 0,
                       "e.g. checkpoint_every: 100; 0 disables periodic checkpoints")
        integer(self.keep_last, "keep_last", 1,
                       "set keep_last: 1 or more (the newest checkpoint is always kept); "
                       "keep_every keeps older ones too")
        integer(self.keep_every, "keep_every", 0, "0 keeps no extra older checkpoints")
        if self.every and self.keep_every and self.keep_every % self.every:
            lcm = self.every * self.keep_every // math.gcd(self.every, self.keep_every)
            near = sorted({max(self.every, self.keep_every // self.every * self.every),
                           (self.keep_every // self.every + 1) * self.every})
            raise ConfigError("keep_every", f"{self.keep_every} is not a multiple of "
                              f"checkpoint_every {self.every}: only the steps that are both "
                              f"checkpointed and kept, every {lcm}, would stay.",
                              f"use a multiple of {self.every}, e.g. keep_every: "
                              + " or ".join(map(str, near)))
        number(self.wait_s, "checkpoint_wait_s",
                      fix="e.g. checkpoint_wait_s: 30 (seconds)")
        number(self.upload_timeout_s, "checkpoint_upload_timeout_s", above=True,
               fix="e.g. checkpoint_upload_timeout_s: 3600 (seconds a checkpoint may take "
                   "to upload and commit before it is given up)")
        text(self.resume, "resume",
                    fix="use resume: latest (or auto: latest if there is one, else fresh), or "
                        "the URI of a checkpoint root or step directory")
        r = self.resume
        close = (did_you_mean(r, OWN_RESUMES) if isinstance(r, str) and r not in OWN_RESUMES
                 and "/" not in r and "\\" not in r else None)
        # a near word that is no path (was: read as the path ./lastest, "no intact checkpoint
        # under .../lastest"; found by a new user, session 47); the disk is asked only then
        if close and isinstance(r, str) and not os.path.exists(r):
            raise ConfigError("resume", f"{r!r} is neither a checkpoint path that exists "
                              "nor a resume word.", f"did you mean {close!r}?")
        # options for a fork from an object store with local checkpoints of its own: the
        # resume's (was: refused, with fixes that broke the resume or moved the checkpoints)
        remote = isinstance(self.resume, str) and self.resume not in OWN_RESUMES \
            and _remote(self.resume)
        if self.uri is not None:
            mine = options if _remote(self.uri) or not remote else {}
            self._put("location", StorageLocation.parse(self.uri, mine))
        elif options and not remote and (self.every > 0 or self.resume in OWN_RESUMES):
            raise ConfigError("checkpoint_options", "are given but checkpoint_uri is not, and "
                              "the default (<run dir>/checkpoints) is a local directory, which "
                              "takes no options.",
                              "set checkpoint_uri to the s3:// or gs:// URI they are for, or "
                              "remove checkpoint_options")
        if self.resume is not None and self.resume not in OWN_RESUMES:
            root, step = split_step_dir(self.resume)
            self._put("resume_step", step)
            try:
                self._put("resume_location", StorageLocation.parse(root, options))
            except ConfigError as e:
                if e.field != "checkpoint_uri":
                    raise
                raise ConfigError("resume", e.problem, e.fix) from None

    def __repr__(self) -> str:
        shown = {f: getattr(self, f) for f in self.field_names()}
        return f"Checkpoints({', '.join(f'{k}={v!r}' for k, v in scrub(shown, self.secrets).items())})"

    @property
    def enabled(self) -> bool:
        """Whether the job writes checkpoints: periodic ones, or a URI was given."""
        return self.every > 0 or self.uri is not None
