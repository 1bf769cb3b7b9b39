"""Every endpoint of sproutd the SDK calls, by its docs/openapi.json operationId.

``tests/test_drift.py`` checks this table against the OpenAPI document both
ways: each route here exists with this method, and each operation there is
here (so an endpoint the server adds is noticed).
"""

from __future__ import annotations

from typing import Dict, Tuple, Union
from urllib.parse import quote

#: operationId -> (method, path template)
ROUTES: Dict[str, Tuple[str, str]] = {
    "health": ("GET", "/v1/health"),
    "info": ("GET", "/v1/info"),
    "openapi": ("GET", "/v1/openapi.json"),
    "metrics": ("GET", "/metrics"),
    "schedule": ("POST", "/v1/runtime/schedule"),
    "listVms": ("GET", "/v1/runtime/vms"),
    "getVm": ("GET", "/v1/runtime/vms/{id}"),
    "deleteVm": ("DELETE", "/v1/runtime/vms/{id}"),
    "exec": ("POST", "/v1/runtime/vms/{id}/exec"),
    "listProcesses": ("GET", "/v1/runtime/vms/{id}/processes"),
    "processEvents": ("GET", "/v1/runtime/vms/{id}/processes/{execId}/events"),
    "processStdin": ("POST", "/v1/runtime/vms/{id}/processes/{execId}/stdin"),
    "processSignal": ("POST", "/v1/runtime/vms/{id}/processes/{execId}/signal"),
    "listFiles": ("GET", "/v1/runtime/vms/{id}/files"),
    "deleteFile": ("DELETE", "/v1/runtime/vms/{id}/files"),
    "readFile": ("GET", "/v1/runtime/vms/{id}/files/content"),
    "writeFile": ("PUT", "/v1/runtime/vms/{id}/files/content"),
    "mkdir": ("POST", "/v1/runtime/vms/{id}/files/mkdir"),
    "readRaw": ("GET", "/v1/runtime/vms/{id}/files/raw"),
    "writeRaw": ("PUT", "/v1/runtime/vms/{id}/files/raw"),
    "pauseVm": ("POST", "/v1/runtime/vms/{id}/pause"),
    "resumeVm": ("POST", "/v1/runtime/vms/{id}/resume"),
    "sleepVm": ("POST", "/v1/runtime/vms/{id}/sleep"),
    "hibernateVm": ("POST", "/v1/runtime/vms/{id}/hibernate"),
    "wakeVm": ("POST", "/v1/runtime/vms/{id}/wake"),
    "rebootVm": ("POST", "/v1/runtime/vms/{id}/reboot"),
    "archiveVm": ("POST", "/v1/runtime/vms/{id}/archive"),
    "unarchiveVm": ("POST", "/v1/runtime/vms/{id}/unarchive"),
    "snapshotVm": ("POST", "/v1/runtime/vms/{id}/snapshot"),
    "forkVm": ("POST", "/v1/runtime/vms/{id}/fork"),
    "createCheckpoint": ("POST", "/v1/runtime/vms/{id}/checkpoints"),
    "listCheckpoints": ("GET", "/v1/runtime/vms/{id}/checkpoints"),
    "restoreCheckpoint": ("POST", "/v1/runtime/checkpoints/{id}/restore"),
    "spawnCheckpoint": ("POST", "/v1/runtime/checkpoints/{id}/spawn"),
    "deleteCheckpoint": ("DELETE", "/v1/runtime/checkpoints/{id}"),
    "openPort": ("POST", "/v1/runtime/vms/{id}/ports"),
    "listPorts": ("GET", "/v1/runtime/vms/{id}/ports"),
    "closePort": ("DELETE", "/v1/runtime/vms/{id}/ports/{port}"),
    "listSnapshots": ("GET", "/v1/runtime/snapshots"),
    "getSnapshot": ("GET", "/v1/runtime/snapshots/{id}"),
    "deleteSnapshot": ("DELETE", "/v1/runtime/snapshots/{id}"),
    "listTemplates": ("GET", "/v1/runtime/templates"),
}


def route(op: str, **params: Union[str, int]) -> Tuple[str, str]:
    """The method and the path of operation ``op``, its ``{params}`` filled in
    (each percent-encoded whole: an id can never become another path)."""
    method, template = ROUTES[op]
    path = template
    for k, v in params.items():
        seg = str(v)
        if not seg:
            raise ValueError(f"{op}: {k} is empty")
        path = path.replace("{" + k + "}", quote(seg, safe=""))
    if "{" in path:
        raise ValueError(f"{op}: missing a parameter of {template}")
    return method, path
