"""Regenerate the protobuf and gRPC modules in clusterwatch/v1, clusterwatch/kubelet and clusterwatch/etcd from proto/.

Usage:
    python scripts/gen_protos.py           # rewrite clusterwatch/{v1,kubelet,etcd}/*_pb2*.py[i]
    python scripts/gen_protos.py --check   # exit 1 if the committed files are stale

clusterwatch/v1 is our own API; clusterwatch/kubelet holds the subset of the
kubelet's pod-resources API the agent calls (proto package ``v1`` as upstream),
clusterwatch/etcd the subset of etcd's v3 API the coordinators call (packages
``etcdserverpb`` and ``mvccpb`` as upstream).

The generated files are committed and never edited by hand; the test command
runs --check so a proto change without regeneration fails CI.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# Each folder's protos are generated into the same folder under the repository root.
PACKAGE_DIRS = (Path("clusterwatch") / "v1", Path("clusterwatch") / "kubelet", Path("clusterwatch") / "etcd")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_root: Path) -> list[Path]:
    """Generate every proto under proto/ into out_root; return the files written."""
    sources = sorted(
        str(p.relative_to(PROTO_ROOT)) for d in PACKAGE_DIRS for p in (PROTO_ROOT / d).glob("*.proto")
    )
    include = Path(protoc.__file__).parent / "_proto"
    argv = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *sources,
    ]
    # protoc finds the mypy-protobuf plugins on PATH, next to this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if protoc.main(argv) != 0:
        raise SystemExit("protoc failed")
    return generated_files(out_root)


def generated_files(root: Path) -> list[Path]:
    """The generated files under ``root``'s package folders."""
    folders = [root / d for d in PACKAGE_DIRS if (root / d).is_dir()]
    return sorted(p for folder in folders for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ")
    args = parser.parse_args()
    if not args.check:
        for old in generated_files(ROOT):
            old.unlink()
        for path in generate(ROOT):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {str(p.relative_to(tmp)): p for p in generate(Path(tmp))}
        committed = {str(p.relative_to(ROOT)): p for p in generated_files(ROOT)}
        stale = sorted(
            name
            for name in fresh.keys() | committed.keys()
            if name not in fresh
            or name not in committed
            or not filecmp.cmp(fresh[name], committed[name], shallow=False)
        )
    if stale:
        print(
            f"generated protobuf code is stale: {', '.join(stale)}; run python scripts/gen_protos.py",
            file=sys.stderr,
        )
        return 1
    print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
