"""``detect(spec)``: ``nvml`` (default), ``fake:8xH200``, ``none``, ``twin:...`` or a JSON file path."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from .fake import no_gpus, parse_fake
from .model import Inventory, InventoryError
from .nvml import read_nvml


def host_facts() -> tuple[int, int, str]:
    import psutil
    return int(psutil.virtual_memory().total), int(os.cpu_count() or 1), socket.gethostname()


def detect(spec: str = "nvml") -> Inventory:
    spec = (spec or "nvml").strip()
    if spec == "nvml":
        return read_nvml(*host_facts())
    if spec == "none":
        return no_gpus(*host_facts())
    if spec.startswith("fake:") or spec.startswith("twin:"):
        inv = parse_fake(spec)
        if spec.startswith("twin:"):
            from dataclasses import replace
            inv = replace(inv, source="twin:" + inv.source.split(":", 1)[1])
        return inv
    path = Path(spec)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InventoryError(f"{path}: not a readable inventory JSON ({exc})") from exc
        if not isinstance(data, dict) or "gpus" not in data:
            raise InventoryError(f"{path}: missing key 'gpus'; write it with `pdctl detect --json > FILE`")
        try:
            return Inventory.from_json(data, source=f"file:{path}")
        except (KeyError, TypeError, ValueError) as exc:
            raise InventoryError(f"{path}: bad GPU record ({exc!r})") from exc
    raise InventoryError(f"--gpus {spec!r}: not nvml, none, fake:NxKIND[+NxKIND], twin:NxKIND or an existing "
                         "JSON file")
