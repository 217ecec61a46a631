"""Wheels that let the Ray benchmarks run on the lent device machine (not a benchmark).

That machine (an H200 host, 16 CPU cores) has torch, pyarrow, rich and yaml but no Ray, and a
call carries at most 64 MiB. Ray's own wheel is 79 MB, 31 MB of it Java jars; this writes, into
``.whl/`` (add ``/.whl/`` to ``.git/info/exclude``), the wheels for the host's Python of this
Ray's version without the jars, the dashboard's source maps and RLlib (44 MB), plus Ray's
missing requirements (jsonschema and its own) and crc32c. On the machine (session 24 ran
``bench/recovery.py`` this way; docs/benchmarks.md):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD RAY_TMPDIR=$(mktemp -d) RAY_AUTH_MODE=disabled
    python3 bench/recovery.py ...          # carry: [".whl"]

Ray Train's loops (the Ray Train side of overhead/recovery/preemption) need more of Ray's
extras and were not tried.

    python bench/device_wheels.py [--python 3.12] [--out .whl]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile

PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]
EXTRA = ["jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "crc32c"]


def _drop(name: str) -> bool:
    return (name.startswith(("ray/jars/", "ray/rllib/")) or name.endswith(".js.map"))


def download(names: list[str], python: str, dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + names, check=True)


def slim(src: str, dst: str) -> None:
    """The wheel without ``_drop``'s files, its RECORD without their lines."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if _drop(info.filename):
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines()
                         if not _drop(ln.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="3.12", help="the device machine's Python")
    ap.add_argument("--out", default=".whl")
    a = ap.parse_args()
    import ray

    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        download([f"ray=={ray.__version__}"], a.python, tmp)
        (name,) = [f for f in os.listdir(tmp) if f.startswith("ray-")]
        slim(os.path.join(tmp, name), os.path.join(a.out, name))
    download(EXTRA, a.python, a.out)
    total = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(f"{a.out}: {total / 2**20:.1f} MiB (a call carries 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
