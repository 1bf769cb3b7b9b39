//! The OpenAPI document of the REST API, generated from the code: each
//! handler's `#[utoipa::path]` (its path, parameters, bodies and answers),
//! each type's `ToSchema` derive (which reads the same serde attributes as
//! the JSON the service emits), and each handler's error codes, declared
//! beside it with [`errors!`] and mapped to statuses by [`Code::status`].
//! The router and this document are made from one list
//! ([`super::routes::api`]).
//!
//! Served at `GET /v1/openapi.json` and committed as docs/openapi.json; a
//! test fails when the two differ (`SPROUT_UPDATE_OPENAPI=1 cargo test -p
//! service openapi` rewrites the file).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::{ContentBuilder, ObjectBuilder, OpenApi, RefOr, Type};

use super::error::Code;

const DESCRIPTION: &str = "\
The Sprout sandbox service: KVM microVM sandboxes over REST (docs/api.md).

Conventions: JSON bodies and answers with camelCase field names. Request \
bodies are strict (an unknown field is refused), must be `Content-Type: \
application/json` and at most 1 MiB; an empty body counts as `{}`. Every \
answer carries `X-Request-Id` (the request's own when it sent one). Times \
are RFC 3339 UTC with milliseconds.

Every error answer, whatever made it, is the envelope `ErrorEnvelope`: \
`{\"error\": {\"code\", \"message\", \"field\"?}}`. Branch on `code`, never on \
`message`; codes are stable (`ErrorCode` lists them all). Beside each \
operation's own errors: an unknown route is `404 not_found`, a method the \
route does not serve `405 method_not_allowed` (with `Allow`), and any \
operation may answer `500 internal`.

Tenants: a sproutd run with `--tenants FILE` answers every operation but \
`/v1/health` and `/v1/openapi.json` only with an API key (`Authorization: \
Bearer KEY` or `X-API-Key: KEY`; else `401 unauthorized`); each key's tenant \
sees only its own sandboxes, snapshots and checkpoints (another tenant's id \
is answered exactly as an unknown one) and holds at most its quota of \
running sandboxes (`402 quota_exhausted`) and execs in flight (`429`).

Exec concurrency: at most `--max-execs-per-vm` execs in flight in one \
sandbox and `--max-execs` in the service (`/v1/info` shows them); one more \
is answered `429 too_many_requests` with `Retry-After` (seconds) at once.";

#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "sproutd", description = DESCRIPTION),
    servers((url = "http://127.0.0.1:7070", description = "sproutd's default --listen")),
    components(schemas(
        super::error::Envelope,
        Code,
        super::exec::Chunk,
        super::exec::ExitEvent,
        super::procs::GapEvent,
    )),
    tags(
        (name = "service", description = "Health, information, metrics and this document"),
        (name = "sandboxes", description = "Create, list, get and delete sandboxes"),
        (name = "exec", description = "Run commands in a sandbox, buffered or streamed"),
        (name = "processes", description = "Background processes: list, attach, stdin, signal"),
        (name = "files", description = "Files under /workspace in a sandbox"),
        (name = "rest states", description = "Pause, resume, sleep, hibernate, wake, reboot, snapshot and fork a sandbox; snapshots"),
        (name = "checkpoints", description = "Named snapshots of a sandbox: take, list, restore in place, spawn, delete"),
        (name = "ports", description = "A sandbox's TCP ports served over HTTP at URLs of their own"),
    )
)]
pub struct ApiDoc;

/// Declares `$name`, the error answers of one operation for its
/// `responses(...)`: the codes listed (and `internal`, which any operation
/// may answer), grouped by their status.
macro_rules! errors {
    ($name:ident = [$($code:ident),* $(,)?]) => {
        struct $name;

        impl utoipa::IntoResponses for $name {
            fn responses() -> std::collections::BTreeMap<
                String,
                utoipa::openapi::RefOr<utoipa::openapi::response::Response>,
            > {
                $crate::daemon::openapi::error_responses(&[$($crate::daemon::Code::$code),*])
            }
        }
    };
}
pub(crate) use errors;

fn envelope_ref() -> RefOr<utoipa::openapi::schema::Schema> {
    RefOr::Ref(utoipa::openapi::Ref::from_schema_name("ErrorEnvelope"))
}

/// The error answers for `codes` and `internal`: one per status, its
/// description naming each code and what it means, an example of each.
pub fn error_responses(codes: &[Code]) -> BTreeMap<String, RefOr<Response>> {
    let mut by_status: BTreeMap<u16, Vec<Code>> = BTreeMap::new();
    for &c in codes.iter().chain([&Code::Internal]) {
        let list = by_status.entry(c.status().as_u16()).or_default();
        if !list.contains(&c) {
            list.push(c);
        }
    }
    by_status
        .into_iter()
        .map(|(status, codes)| {
            let text: Vec<String> = codes
                .iter()
                .map(|c| format!("`{}`: {}", c.name(), c.meaning()))
                .collect();
            let content = ContentBuilder::new()
                .schema(Some(envelope_ref()))
                .examples_from_iter(codes.iter().map(|c| {
                    let value = serde_json::json!({
                        "error": { "code": c.name(), "message": c.meaning() }
                    });
                    (c.name(), ExampleBuilder::new().value(Some(value)))
                }));
            let mut resp = ResponseBuilder::new()
                .description(text.join("\n\n"))
                .content("application/json", content.build());
            if status == 429 || codes.contains(&Code::TemplateBuilding) {
                resp = resp.header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(
                            ObjectBuilder::new()
                                .schema_type(Type::Integer)
                                .minimum(Some(1)),
                        )
                        .description(Some("Seconds to wait before retrying"))
                        .build(),
                );
            }
            (status.to_string(), RefOr::T(resp.build()))
        })
        .collect()
}

/// Puts `X-Request-Id` on every answer of `doc`, and on every operation
/// but the public ones the API key scheme and its `401 unauthorized`.
fn finish(mut doc: OpenApi) -> OpenApi {
    use utoipa::openapi::security::{
        HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
    };
    let unauthorized = error_responses(&[Code::Unauthorized]).remove("401");
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "apiKey",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "With sproutd --tenants: the tenant's API key, as `Authorization: Bearer KEY` \
                     (or `X-API-Key: KEY`). Without it, no key is needed.",
                ))
                .build(),
        ),
    );
    for (path, item) in doc.paths.paths.iter_mut() {
        let public = super::tenants::public(path);
        let ops = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
            &mut item.head,
            &mut item.options,
            &mut item.trace,
        ];
        for op in ops.into_iter().flatten() {
            if public {
                op.security = Some(vec![SecurityRequirement::default()]);
            } else {
                op.security = Some(vec![SecurityRequirement::new(
                    "apiKey",
                    Vec::<String>::new(),
                )]);
                if let Some(r) = &unauthorized {
                    op.responses.responses.insert("401".into(), r.clone());
                }
            }
        }
    }
    for item in doc.paths.paths.values_mut() {
        let ops = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
            &mut item.head,
            &mut item.options,
            &mut item.trace,
        ];
        for op in ops.into_iter().flatten() {
            for r in op.responses.responses.values_mut() {
                if let RefOr::T(r) = r {
                    r.headers.insert(
                        "X-Request-Id".into(),
                        HeaderBuilder::new()
                            .schema(ObjectBuilder::new().schema_type(Type::String))
                            .description(Some(
                                "The request's own X-Request-Id when it sent one, else a new UUID",
                            ))
                            .build(),
                    );
                }
            }
        }
    }
    doc
}

/// The document, made from the router's list of endpoints.
pub fn document() -> OpenApi {
    let (_, doc) = super::routes::api().split_for_parts();
    finish(doc)
}

/// The document as docs/openapi.json has it: pretty-printed, every
/// object's keys sorted, a newline at the end.
pub fn to_json(doc: &OpenApi) -> String {
    let v = sorted(serde_json::to_value(doc).unwrap_or_default());
    let mut s = serde_json::to_string_pretty(&v).unwrap_or_default();
    s.push('\n');
    s
}

fn sorted(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let m: BTreeMap<String, Value> = m.into_iter().map(|(k, v)| (k, sorted(v))).collect();
            Value::Object(m.into_iter().collect())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sorted).collect()),
        v => v,
    }
}

/// The document served at `/v1/openapi.json` (made once).
pub fn json() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| to_json(&document()))
}

/// Whether `value`, as the service emits it, fits `schema` (a schema of
/// `doc`, the document as JSON): no key the schema does not name (so serde
/// renames and the schema agree: an object schema with `properties` admits
/// no other key unless `additionalProperties` says so), every required key present, each value
/// of the schema's type or enum. Follows `$ref`s, `oneOf`, arrays and maps.
/// The error says where it does not fit.
pub fn fits(
    doc: &serde_json::Value,
    schema: &serde_json::Value,
    value: &serde_json::Value,
) -> Result<(), String> {
    fits_at(doc, schema, value, "$")
}

/// Whether `value`, the JSON answer of `method` on the documented `path`
/// (a template such as `/v1/runtime/vms/{id}`) with `status`, fits what
/// `doc` says of it.
pub fn fits_answer(
    doc: &serde_json::Value,
    method: &str,
    path: &str,
    status: u16,
    value: &serde_json::Value,
) -> Result<(), String> {
    let op = &doc["paths"][path][method.to_ascii_lowercase()];
    if op.is_null() {
        return Err(format!("{method} {path} is not documented"));
    }
    let r = &op["responses"][status.to_string()];
    if r.is_null() {
        return Err(format!(
            "{method} {path} does not document a {status} answer"
        ));
    }
    let schema = &r["content"]["application/json"]["schema"];
    if schema.is_null() {
        return Err(format!("{method} {path} {status} has no JSON schema"));
    }
    fits(doc, schema, value)?;
    if let Some(code) = value["error"]["code"].as_str() {
        if r["content"]["application/json"]["examples"]
            .get(code)
            .is_none()
        {
            return Err(format!("{method} {path} does not document {status} {code}"));
        }
    }
    Ok(())
}

fn resolve<'a>(
    doc: &'a serde_json::Value,
    mut s: &'a serde_json::Value,
) -> Result<&'a serde_json::Value, String> {
    while let Some(r) = s["$ref"].as_str() {
        let name = r
            .strip_prefix("#/components/schemas/")
            .ok_or_else(|| format!("a $ref outside the schemas: {r}"))?;
        s = &doc["components"]["schemas"][name];
        if s.is_null() {
            return Err(format!("no schema {name}"));
        }
    }
    Ok(s)
}

fn fits_at(
    doc: &serde_json::Value,
    schema: &serde_json::Value,
    v: &serde_json::Value,
    at: &str,
) -> Result<(), String> {
    use serde_json::Value;
    let s = resolve(doc, schema)?;
    if let Some(alts) = s["oneOf"].as_array().or(s["anyOf"].as_array()) {
        return if alts.iter().any(|a| fits_at(doc, a, v, at).is_ok()) {
            Ok(())
        } else {
            Err(format!("{at}: {v} fits none of the schema's alternatives"))
        };
    }
    let types: Vec<&str> = match &s["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(t) => t.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_u64() || n.is_i64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let typed = types.contains(&kind) || (kind == "integer" && types.contains(&"number"));
    if !types.is_empty() && !typed {
        return Err(format!("{at}: {v} is {kind}, the schema says {types:?}"));
    }
    if let Some(e) = s["enum"].as_array() {
        if !e.contains(v) {
            return Err(format!("{at}: {v} is not one of {e:?}"));
        }
    }
    match v {
        Value::Object(m) => {
            for k in s["required"].as_array().into_iter().flatten() {
                let k = k.as_str().unwrap_or_default();
                if !m.contains_key(k) {
                    return Err(format!("{at}: no {k}"));
                }
            }
            for (k, x) in m {
                let at = format!("{at}.{k}");
                match s["properties"].get(k) {
                    Some(p) => fits_at(doc, p, x, &at)?,
                    None => match &s["additionalProperties"] {
                        p @ Value::Object(_) => fits_at(doc, p, x, &at)?,
                        Value::Bool(true) => {}
                        // A free-form object.
                        Value::Null if s.get("properties").is_none() => {}
                        // Stricter than JSON Schema, on purpose: a key the
                        // schema does not name is a rename gone wrong.
                        _ => return Err(format!("{at} is not in the schema")),
                    },
                }
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                fits_at(doc, &s["items"], x, &format!("{at}[{i}]"))?;
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use serde_json::Value;

    const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json");

    fn doc() -> Value {
        serde_json::from_str(json()).unwrap()
    }

    #[test]
    fn openapi_document_is_the_committed_one() {
        let fresh = json();
        if std::env::var_os("SPROUT_UPDATE_OPENAPI").is_some_and(|v| v == "1") {
            std::fs::write(COMMITTED, fresh).unwrap();
            return;
        }
        let committed = std::fs::read_to_string(COMMITTED).unwrap_or_default();
        if committed != fresh {
            let first = committed
                .lines()
                .zip(fresh.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(committed.lines().count().min(fresh.lines().count()));
            panic!(
                "docs/openapi.json is not what the code generates (first difference at line {}: \
                 committed {:?}, generated {:?}).\nRegenerate it with:\n  \
                 SPROUT_UPDATE_OPENAPI=1 cargo test -p service openapi\nand commit it.",
                first + 1,
                committed.lines().nth(first).unwrap_or("<end>"),
                fresh.lines().nth(first).unwrap_or("<end>"),
            );
        }
    }

    fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
        let mut out = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                out.push((path.clone(), method.clone(), op));
            }
        }
        out
    }

    #[test]
    fn openapi_every_operation_has_an_id_a_summary_errors_and_request_ids() {
        let doc = doc();
        let ops = operations(&doc);
        assert_eq!(
            ops.len(),
            42,
            "{:?}",
            ops.iter().map(|o| (&o.0, &o.1)).collect::<Vec<_>>()
        );
        let mut ids = std::collections::BTreeSet::new();
        for (path, method, op) in &ops {
            let what = format!("{method} {path}");
            let id = op["operationId"]
                .as_str()
                .unwrap_or_else(|| panic!("{what}: no id"));
            assert!(ids.insert(id.to_owned()), "{what}: operationId {id} twice");
            assert!(
                op["summary"].as_str().is_some_and(|s| !s.is_empty()),
                "{what}"
            );
            assert!(!op["tags"].as_array().unwrap().is_empty(), "{what}");
            let responses = op["responses"].as_object().unwrap();
            assert!(responses.contains_key("500"), "{what}: no 500");
            assert!(
                responses.keys().any(|k| k.starts_with('2')),
                "{what}: no success answer"
            );
            for (status, r) in responses {
                assert!(
                    r["headers"].get("X-Request-Id").is_some(),
                    "{what} {status}: no X-Request-Id"
                );
                if status.starts_with('4') || status.starts_with('5') {
                    let schema = &r["content"]["application/json"]["schema"]["$ref"];
                    assert_eq!(
                        schema, "#/components/schemas/ErrorEnvelope",
                        "{what} {status}"
                    );
                }
                if status == "429" {
                    assert!(r["headers"].get("Retry-After").is_some(), "{what}");
                }
            }
            // Every path parameter is described.
            for name in path.split('{').skip(1).filter_map(|p| p.split('}').next()) {
                let params = op["parameters"]
                    .as_array()
                    .unwrap_or_else(|| panic!("{what}"));
                assert!(
                    params
                        .iter()
                        .any(|p| p["name"] == name && p["in"] == "path"),
                    "{what}: path parameter {name} undocumented"
                );
            }
        }
    }

    /// Every code an operation declares is one of the codes its status
    /// says, and every code is answered by some operation (or the router).
    #[test]
    fn openapi_every_error_code_is_documented_where_it_can_happen() {
        let doc = doc();
        let mut seen = std::collections::BTreeSet::new();
        for (_, _, op) in operations(&doc) {
            for (status, r) in op["responses"].as_object().unwrap() {
                let Some(ex) = r["content"]["application/json"]["examples"].as_object() else {
                    continue;
                };
                for (name, e) in ex {
                    let code = Code::ALL.iter().find(|c| c.name() == *name).unwrap();
                    assert_eq!(code.status().as_u16().to_string(), *status, "{name}");
                    assert_eq!(e["value"]["error"]["code"], *name);
                    seen.insert(code.name());
                }
            }
        }
        let schema = &doc["components"]["schemas"]["ErrorCode"]["enum"];
        let listed: Vec<&str> = schema
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        for c in Code::ALL {
            assert!(
                listed.contains(&c.name().as_str()),
                "{c:?} not in ErrorCode"
            );
            // The router's own, and a port's URL's (no operation of the
            // document: docs/api.md, "Ports").
            let elsewhere = matches!(
                c,
                Code::NotFound | Code::MethodNotAllowed | Code::PortNotListening
            );
            assert!(
                seen.contains(&c.name()) || elsewhere,
                "no operation answers {c:?}"
            );
        }
        assert_eq!(listed.len(), Code::ALL.len());
    }

    pub fn assert_fits(name: &str, value: &Value) {
        let schema = serde_json::json!({ "$ref": format!("#/components/schemas/{name}") });
        if let Err(e) = fits(&doc(), &schema, value) {
            panic!("{name}: {e}");
        }
    }

    #[test]
    fn openapi_the_error_envelope_fits_its_schema() {
        use axum::response::IntoResponse as _;
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for e in [
            super::super::ApiError::new(Code::VmNotFound, "no"),
            super::super::ApiError::field("cpus", "cpus is 9"),
        ] {
            let r = e.into_response();
            let b = rt
                .block_on(axum::body::to_bytes(r.into_body(), 4096))
                .unwrap();
            assert_fits("ErrorEnvelope", &serde_json::from_slice(&b).unwrap());
        }
        let schema = serde_json::json!({ "$ref": "#/components/schemas/ErrorEnvelope" });
        for bad in [
            serde_json::json!({"error": {"code": "vm_not_found", "message": "x", "extra": 1}}),
            serde_json::json!({"error": {"code": "no_such_code", "message": "x"}}),
            serde_json::json!({"error": {"code": "vm_not_found"}}),
            serde_json::json!({"error": {"code": "vm_not_found", "message": 1}}),
        ] {
            assert!(fits(&doc(), &schema, &bad).is_err(), "{bad}");
        }
    }
}
