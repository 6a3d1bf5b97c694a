"""The part of kustomize that deploy/kubernetes uses, so tests can build its objects offline.

``build(folder)`` reads a kustomization as ``kubectl kustomize`` does for the
features used there: ``resources`` (YAML files and folders holding a
kustomization), ``components`` (kind Component), ``patches`` given as RFC 6902
operations with a ``target`` (group, kind, name; an absent field matches any)
and ``images`` (``newTag``, ``newName``). Anything else in a kustomization
fails loudly instead of being ignored. tests/deploy/test_kubernetes.py compares
the result with the real ``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images"}


def build(folder: Path, files_under: Path | None = None) -> list[tuple[str, Doc]]:
    """Every object ``kubectl kustomize folder`` prints, each with the file it came from
    (relative to ``files_under``, default ``folder``)."""
    return _build(folder.resolve(), (files_under or folder).resolve())


def kustomization(folder: Path) -> Doc:
    doc: Doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(doc) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml: tests/kustomize.py does not build {sorted(unknown)}")
    return doc


def _build(folder: Path, root: Path) -> list[tuple[str, Doc]]:
    spec = kustomization(folder)
    objects: list[tuple[str, Doc]] = []
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            objects.extend(_build(path, root))
        else:
            objects.extend(
                (os.path.relpath(path, root), doc) for doc in yaml.safe_load_all(path.read_text()) if doc
            )
    patches = list(spec.get("patches", []))
    for entry in spec.get("components", []):
        component = kustomization((folder / entry).resolve())
        if component["kind"] != "Component":
            raise ValueError(f"{folder / entry} is a {component['kind']}, not a Component")
        if component.get("resources") or component.get("images") or component.get("components"):
            raise ValueError(f"{folder / entry}: tests/kustomize.py applies only a component's patches")
        patches.extend(component.get("patches", []))
    objects = [(path, _patched(doc, patches)) for path, doc in objects]
    for image in spec.get("images", []):
        for _, doc in objects:
            _set_image(doc, image)
    return objects


def matches(target: Doc, doc: Doc) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    wanted = {"group": group, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(target[key] == value for key, value in wanted.items() if key in target)


def _patched(doc: Doc, patches: list[Doc]) -> Doc:
    for patch in patches:
        if matches(patch["target"], doc):
            doc = json_patch(doc, yaml.safe_load(patch["patch"]))
    return doc


def json_patch(doc: Doc, operations: list[Doc]) -> Doc:
    """``doc`` with RFC 6902 ``add`` and ``replace`` operations applied (others fail)."""
    doc = copy.deepcopy(doc)
    for operation in operations:
        *parents, last = operation["path"].lstrip("/").split("/")
        where: Any = doc
        for key in parents:
            where = where[int(key)] if isinstance(where, list) else where[key]
        if operation["op"] == "add" and isinstance(where, list):
            if last != "-":
                raise ValueError(f"add into a list only appends here: {operation}")
            where.append(operation["value"])
        elif operation["op"] == "add" or (operation["op"] == "replace" and last in where):
            where[last] = operation["value"]
        else:
            raise ValueError(f"not applied: {operation}")
    return doc


def _set_image(doc: Doc, image: Doc) -> None:
    pod = _pod_spec(doc)
    if pod is None:
        return
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def _pod_spec(doc: Doc) -> Doc | None:
    template = doc.get("spec", {}).get("template")
    return template["spec"] if isinstance(template, dict) else None
