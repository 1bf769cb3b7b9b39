"""The SDK's models and routes against docs/openapi.json (and the running
server's own document): a server change that the SDK does not follow fails here.

For every schema of ``components.schemas`` there is a model (or an enum alias)
and nothing else: each model's fields are the schema's properties (JSON names),
a field without a default is exactly a required property, a field is
``Optional`` exactly when its property is nullable or not required, and its
type is the property's (nested models, lists, maps, date-times, enums).
The routes table is the document's operations, both ways; the error codes'
statuses are the document's.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import typing
from copy import deepcopy
from pathlib import Path
from typing import Any, Dict, List, Union

import pytest

from sprout import errors, models
from sprout._routes import ROUTES

REPO = Path(__file__).resolve().parents[3]
OPENAPI = Path(os.environ.get("SPROUT_OPENAPI", REPO / "docs" / "openapi.json"))
#: Schemas that are neither a model nor a string enum.
SPECIAL = {"Signal": models.Signal}


def load() -> Dict[str, Any]:
    with open(OPENAPI) as f:
        return json.load(f)


# ---------------------------------------------------------------- the checker


def _split_null(s: Dict[str, Any]) -> "tuple[bool, Dict[str, Any]]":
    """(nullable, the schema without its null)."""
    s = dict(s)
    t = s.get("type")
    if isinstance(t, list) and "null" in t:
        rest = [x for x in t if x != "null"]
        s["type"] = rest[0] if len(rest) == 1 else rest
        return True, s
    for key in ("oneOf", "anyOf"):
        if key in s:
            alts = [a for a in s[key] if a.get("type") != "null"]
            if len(alts) < len(s[key]):
                if len(alts) == 1:
                    merged = {k: v for k, v in s.items() if k != key}
                    merged.update(alts[0])
                    return True, merged
                s[key] = alts
                return True, s
    return False, s


def _unwrap_optional(tp: Any) -> "tuple[bool, Any]":
    if typing.get_origin(tp) is Union:
        args = typing.get_args(tp)
        if type(None) in args:
            rest = tuple(a for a in args if a is not type(None))
            return True, (rest[0] if len(rest) == 1 else Union[rest])  # type: ignore[return-value]
    return False, tp


def check_type(
    schema: Dict[str, Any], tp: Any, where: str, doc: Dict[str, Any], enum_of: Any, problems: List[str]
) -> None:
    """Appends to ``problems`` where annotation ``tp`` does not match ``schema``."""
    comps = doc["components"]["schemas"]
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        target = comps[name]
        if name in models.SCHEMA_ENUMS:
            if tp is not str or enum_of != name:
                problems.append(f"{where}: the schema is the enum {name}: expected str listed in ENUM_FIELDS as {name}")
        elif name in SPECIAL:
            if tp != SPECIAL[name]:
                problems.append(f"{where}: expected {SPECIAL[name]}, the SDK has {tp}")
        elif not (isinstance(tp, type) and issubclass(tp, models.Model) and tp.__schema__ == name):
            problems.append(f"{where}: expected the model of {name}, the SDK has {tp}")
        del target
        return
    if "oneOf" in schema:
        problems.append(f"{where}: a oneOf the checker does not know: {schema}")
        return
    t = schema.get("type")
    if t == "string":
        want: Any = datetime.datetime if schema.get("format") == "date-time" else str
        if "enum" in schema:
            problems.append(f"{where}: an inline enum {schema['enum']}: the SDK types none")
        if tp is not want:
            problems.append(f"{where}: expected {want.__name__}, the SDK has {tp}")
    elif t == "integer":
        if tp is not int:
            problems.append(f"{where}: expected int, the SDK has {tp}")
    elif t == "number":
        if tp is not float:
            problems.append(f"{where}: expected float, the SDK has {tp}")
    elif t == "boolean":
        if tp is not bool:
            problems.append(f"{where}: expected bool, the SDK has {tp}")
    elif t == "array":
        if typing.get_origin(tp) not in (list, List):
            problems.append(f"{where}: expected a List, the SDK has {tp}")
            return
        # A list of enum values: ENUM_FIELDS names the items' enum.
        check_type(schema["items"], typing.get_args(tp)[0], where + "[]", doc, enum_of, problems)
    elif t == "object" and "properties" in schema:
        if not (isinstance(tp, type) and issubclass(tp, models.Model)):
            problems.append(f"{where}: expected a model of an inline object, the SDK has {tp}")
            return
        check_model(schema, tp, tp.__name__, doc, problems)
    elif t == "object":
        if typing.get_origin(tp) not in (dict, Dict):
            problems.append(f"{where}: expected a Dict, the SDK has {tp}")
            return
        k, v = typing.get_args(tp)
        if k is not str:
            problems.append(f"{where}: map keys are str, the SDK has {k}")
        check_type(schema.get("additionalProperties") or {}, v, where + "{}", doc, None, problems)
    else:
        problems.append(f"{where}: a schema the checker does not know: {schema}")


def check_model(schema: Dict[str, Any], cls: Any, name: str, doc: Dict[str, Any], problems: List[str]) -> None:
    props: Dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", []))
    fields = {models.json_name(f): f for f in dataclasses.fields(cls)}
    hints = models.type_hints(cls)
    for missing in sorted(set(props) - set(fields)):
        problems.append(f"{name}.{missing}: in the schema, not in the SDK's {cls.__name__}")
    for extra in sorted(set(fields) - set(props)):
        problems.append(f"{name}.{extra}: in the SDK's {cls.__name__}, not in the schema")
    for key in sorted(set(props) & set(fields)):
        f = fields[key]
        where = f"{name}.{key}"
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
        if (key in required) == has_default:
            problems.append(
                f"{where}: the schema has it {'required' if key in required else 'optional'}, "
                f"the SDK {'with' if has_default else 'without'} a default"
            )
        nullable, inner = _split_null(props[key])
        optional, tp = _unwrap_optional(hints[f.name])
        if optional != (nullable or key not in required):
            problems.append(
                f"{where}: Optional in the SDK is {optional}, the schema has nullable={nullable}, "
                f"required={key in required}"
            )
        check_type(inner, tp, where, doc, models.ENUM_FIELDS.get((name, f.name)), problems)


def drift(doc: Dict[str, Any]) -> List[str]:
    """Every difference between the SDK's models and ``doc``'s schemas."""
    problems: List[str] = []
    comps: Dict[str, Any] = doc["components"]["schemas"]
    for name, schema in sorted(comps.items()):
        if name in models.SCHEMA_MODELS:
            check_model(schema, models.SCHEMA_MODELS[name], name, doc, problems)
        elif name in models.SCHEMA_ENUMS:
            want = schema.get("enum")
            have = list(typing.get_args(models.SCHEMA_ENUMS[name]))
            if want is None or sorted(want) != sorted(have):
                problems.append(f"enum {name}: the schema has {want}, the SDK {have}")
        elif name not in SPECIAL:
            problems.append(f"schema {name}: no model in sprout.models")
    for name in sorted(set(models.SCHEMA_MODELS) | set(models.SCHEMA_ENUMS) | set(SPECIAL)):
        if name not in comps:
            problems.append(f"sprout.models has {name}, which the schema does not")
    return problems


def route_drift(doc: Dict[str, Any]) -> List[str]:
    ops = {}
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            ops[op["operationId"]] = (method.upper(), path)
    problems = [f"operation {k} {v}: not in sprout._routes.ROUTES" for k, v in sorted(ops.items()) if k not in ROUTES]
    problems += [f"ROUTES[{k!r}]: no such operation" for k in sorted(ROUTES) if k not in ops]
    problems += [
        f"ROUTES[{k!r}] is {ROUTES[k]}, the document {ops[k]}"
        for k in sorted(set(ROUTES) & set(ops))
        if ROUTES[k] != ops[k]
    ]
    return problems


def code_drift(doc: Dict[str, Any]) -> List[str]:
    problems = []
    codes = set(doc["components"]["schemas"]["ErrorCode"]["enum"])
    if codes != set(errors.CODE_STATUS):
        problems.append(
            f"CODE_STATUS: missing {sorted(codes - set(errors.CODE_STATUS))}, "
            f"extra {sorted(set(errors.CODE_STATUS) - codes)}"
        )
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            for status, resp in op["responses"].items():
                for media in resp.get("content", {}).values():
                    for code in media.get("examples", {}):
                        if int(status) >= 400 and errors.CODE_STATUS.get(code) != int(status):
                            problems.append(
                                f"{method.upper()} {path}: {code} is {status}, "
                                f"CODE_STATUS says {errors.CODE_STATUS.get(code)}"
                            )
    return problems


# ---------------------------------------------------------------- the tests


def test_models_match_the_openapi_schemas() -> None:
    problems = drift(load())
    assert not problems, "the SDK's models drifted from docs/openapi.json:\n" + "\n".join(problems)


def test_routes_match_the_openapi_operations() -> None:
    problems = route_drift(load())
    assert not problems, "\n".join(problems)


def test_error_codes_and_statuses_match() -> None:
    problems = code_drift(load())
    assert not problems, "\n".join(problems)


def _vm(doc: Dict[str, Any]) -> Dict[str, Any]:
    return doc["components"]["schemas"]["Vm"]


@pytest.mark.parametrize(
    "change, expect",
    [
        (lambda d: _vm(d)["properties"].__setitem__("newField", {"type": "string"}), "Vm.newField: in the schema"),
        (lambda d: _vm(d)["properties"].pop("hostname"), "Vm.hostname: in the SDK"),
        (lambda d: _vm(d)["required"].remove("hostname"), "Vm.hostname: the schema has it optional"),
        (lambda d: _vm(d)["required"].append("failureReason"), "Vm.failureReason: the schema has it required"),
        (lambda d: _vm(d)["properties"].__setitem__("cpus", {"type": "string"}), "Vm.cpus: expected str"),
        (lambda d: _vm(d)["properties"].__setitem__("image", {"type": ["string", "null"]}), "Vm.image: Optional"),
        (lambda d: d["components"]["schemas"]["VmState"]["enum"].append("frozen"), "enum VmState"),
        (lambda d: d["components"]["schemas"].__setitem__("Brand", {"type": "object"}), "schema Brand: no model"),
        (lambda d: d["components"]["schemas"].pop("Health"), "sprout.models has Health"),
        (
            lambda d: d["components"]["schemas"]["ErrorEnvelope"]["properties"]["error"]["properties"].pop("field"),
            "ErrorEnvelope.error",  # reported as ErrorBody.field
        ),
    ],
)
def test_the_checker_sees_a_change(change: Any, expect: str) -> None:
    """The negative control: each change of the document is reported."""
    doc = deepcopy(load())
    change(doc)
    problems = drift(doc)
    if expect == "ErrorEnvelope.error":
        expect = "ErrorBody.field: in the SDK"
    assert any(expect in p for p in problems), problems


def test_the_route_checker_sees_a_change() -> None:
    doc = deepcopy(load())
    doc["paths"]["/v1/runtime/vms/{id}/teleport"] = {"post": {"operationId": "teleportVm", "responses": {}}}
    doc["paths"]["/v1/runtime/vms/{id}"]["get"]["operationId"] = "fetchVm"
    problems = route_drift(doc)
    assert any("teleportVm" in p for p in problems) and any("getVm" in p for p in problems), problems


@pytest.mark.server
def test_the_running_server_serves_the_same_schemas(client: Any) -> None:
    """The live document (the server under test) against the SDK too."""
    live = client.openapi()
    assert not drift(live), drift(live)
    assert not route_drift(live), route_drift(live)
