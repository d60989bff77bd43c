#!/usr/bin/env python3
"""Write a kustomization for expertd on Kubernetes: N shards x R replicas.

    python deploy/k8s/make_deployment.py OUT --shards 8 --replicas 2 --component h200
    kubectl apply -k OUT

Kustomize has no loops, so this writes what it cannot express: one small kustomization per
shard that uses deploy/k8s/base once (a StatefulSet of R replicas and a headless Service,
named expertd-shard-S and labelled expertd.dev/shard=S), and a top one that lists them,
sets the shard count and the replica count on every StatefulSet, adds the chosen
components (deploy/k8s/components: h200, cpu-synthetic, tls, servicemonitor), the
disruption budgets and a ConfigMap `expertd-addresses` whose EXPERTD_ADDRESSES is the
client's address list. The files say how they were written; rerun this rather than edit
them. Standard library only: it runs wherever Python 3.11 does.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE / "base"
COMPONENTS = HERE / "components"
GRPC_PORT = 50051  # base/service.yaml's grpc port


def _q(value: str) -> str:
    """A YAML scalar, quoted (JSON strings are YAML)."""
    return json.dumps(value)


def _rel(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target, start)).as_posix()


def addresses(shards: int, replicas: int, namespace: str | None) -> list[str]:
    """Shard-major: every replica of shard 0, then shard 1, ... (the client groups them)."""
    domain = f".{namespace}.svc" if namespace else ""
    return [
        f"expertd-shard-{s}-{r}.expertd-shard-{s}{domain}:{GRPC_PORT}"
        for s in range(shards)
        for r in range(replicas)
    ]


def _pdb(name: str, comment: str) -> str:
    return f"""{comment}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {name}
spec:
  maxUnavailable: 1
  selector:
    matchLabels:
      app.kubernetes.io/name: expertd
      app.kubernetes.io/component: shard
"""


def shown(out: Path) -> str:
    """out as the files name it: relative to the repository when inside it."""
    root = HERE.parents[1]
    return _rel(out, root) if out.is_relative_to(root) else out.as_posix()


def command_line(args: argparse.Namespace, out: Path) -> str:
    """The canonical command that writes these files (recorded in each of them)."""
    words = ["deploy/k8s/make_deployment.py", shown(out), "--shards", str(args.shards)]
    words += ["--replicas", str(args.replicas)]
    for c in args.component:
        words += ["--component", c]
    words += ["--image", args.image] + (["--namespace", args.namespace] if args.namespace else [])
    return shlex.join(words)


def render(args: argparse.Namespace, out: Path) -> dict[Path, str]:
    """Path -> text of every file to write under out (an absolute path)."""
    command = command_line(args, out)
    header = f"# Written by: {command}\n# Rerun it rather than edit this file.\n"
    files: dict[Path, str] = {}
    n, r = args.shards, args.replicas
    for s in range(n):
        folder = out / f"shard-{s}"
        resources = [_rel(BASE, folder)] + (["pdb.yaml"] if r > 1 else [])
        files[
            folder / "kustomization.yaml"
        ] = f"""{header}# Shard {s} of {n}: StatefulSet and headless Service expertd-shard-{s}, pods expertd-shard-{s}-0..{r - 1}.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
{"".join(f"  - {x}{chr(10)}" for x in resources)}nameSuffix: -shard-{s}
labels:
  - pairs:
      expertd.dev/shard: {_q(str(s))}
    includeSelectors: true
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: StatefulSet
      metadata:
        name: expertd
      spec:
        template:
          spec:
            containers:
              - name: expertd
                env:
                  - name: EXPERTD_SHARD
                    value: {_q(str(s))}
"""
        if r > 1:
            files[folder / "pdb.yaml"] = header + _pdb(
                "expertd",
                "# One replica of this shard at a time may be evicted (node drains, upgrades);\n"
                "# the others keep serving its experts. Every shard has its own budget, so a\n"
                "# drain may take one replica of each shard at once.",
            )
    top = [f"shard-{s}" for s in range(n)] + (["pdb.yaml"] if r == 1 else [])
    if r == 1:
        files[out / "pdb.yaml"] = header + _pdb(
            "expertd",
            "# One replica per shard: evictions (node drains, upgrades) take at most one shard\n"
            "# down at a time, whose experts are unreachable until it is back (the client\n"
            "# raises CoverageError naming them). Deploy R >= 2 replicas to keep serving.",
        )
    components = [_rel(COMPONENTS / c, out) for c in args.component]
    name, _, tag = args.image.rpartition(":")
    if not name or "/" in tag:  # no tag (a colon, if any, was a registry's port)
        name, tag = args.image, ""
    image = f"  - name: expertd\n    newName: {name}\n" + (
        f"    newTag: {_q(tag)}\n" if tag else ""
    )
    listed = ",".join(addresses(n, r, args.namespace))
    files[
        out / "kustomization.yaml"
    ] = f"""{header}# expertd: {n} shards x {r} replicas ({n * r} pods{", one GPU each" if "h200" in args.component else ""}).
#   kubectl apply -k {shown(out)}
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
{f"namespace: {args.namespace}{chr(10)}" if args.namespace else ""}resources:
{"".join(f"  - {x}{chr(10)}" for x in top)}{"components:" + chr(10) + "".join(f"  - {c}{chr(10)}" for c in components) if components else ""}images:
{image}patches:
  - target:
      kind: StatefulSet
    patch: |-
      apiVersion: apps/v1
      kind: StatefulSet
      metadata:
        name: any
      spec:
        replicas: {r}
        template:
          spec:
            containers:
              - name: expertd
                env:
                  - name: EXPERTD_NUM_SHARDS
                    value: {_q(str(n))}
# The client's address list, shard-major (replicas of a shard side by side); a frontend
# takes it with envFrom: [{{configMapRef: {{name: expertd-addresses}}}}].
configMapGenerator:
  - name: expertd-addresses
    options:
      disableNameSuffixHash: true
      labels:
        app.kubernetes.io/name: expertd
    literals:
      - EXPERTD_ADDRESSES={listed}
"""
    return files


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write (created; its files are replaced)")
    p.add_argument("--shards", type=int, required=True, help="N: EXPERTD_NUM_SHARDS")
    p.add_argument("--replicas", type=int, default=1, help="R: pods per shard (default 1)")
    p.add_argument(
        "--component",
        action="append",
        default=[],
        choices=sorted(c.name for c in COMPONENTS.iterdir() if c.is_dir()),
        help="add a component of deploy/k8s/components (repeatable)",
    )
    p.add_argument("--image", default="expertd:0.1.0", help="NAME[:TAG] of the server image")
    p.add_argument("--namespace", help="set it, and write fully qualified addresses")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.shards < 1 or args.replicas < 1:
        p.error("--shards and --replicas must be at least 1")
    if {"h200", "cpu-synthetic"} <= set(args.component):
        p.error("choose one of the components h200 and cpu-synthetic")
    out = args.out.resolve()
    files = render(args, out)
    stale = [f for f in out.glob("shard-*/*") if f not in files] if out.exists() else []
    for path in stale:
        path.unlink()
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"wrote {out} ({args.shards} shards x {args.replicas} replicas): kubectl apply -k {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
