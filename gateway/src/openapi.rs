//! The API's OpenAPI 3.1 document, generated from the handlers' `#[utoipa::path]` attributes
//! and the request types' schemas; served at `/v1/openapi.json` and checked in as
//! `docs/openapi.json` (a test keeps the two equal).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(title = "sandq gateway", description = "Run untrusted code in sandq sandboxes over HTTP (docs/gateway.md)."),
    paths(
        crate::jobs::submit,
        crate::jobs::get,
        crate::jobs::cancel,
        crate::jobs::events,
        crate::files::artifact,
        crate::files::output,
        crate::files::log,
        crate::files::upload,
        crate::sessions::create,
        crate::sessions::list,
        crate::sessions::delete,
        crate::sessions::files,
        crate::sessions::read,
        crate::sessions::write,
        crate::sessions::remove,
    ),
    components(schemas(crate::jobs::SubmitJob, crate::jobs::InputRef, crate::sessions::CreateSession, crate::problem::Problem)),
    modifiers(&ApiKey)
)]
pub(crate) struct ApiDoc;

/// The bearer API key (`sq_<id>_<secret>`).
struct ApiKey;

impl Modify for ApiKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).bearer_format("sq_<id>_<secret>").build();
        components.add_security_scheme("api_key", SecurityScheme::Http(scheme));
    }
}

/// The document as pretty JSON (what `/v1/openapi.json` serves).
pub(crate) fn json() -> String {
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_checked_in_document_is_the_generated_one() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
        let generated = super::json();
        if std::env::var_os("SANDQ_WRITE_OPENAPI").is_some() {
            std::fs::write(&path, &generated).expect("write docs/openapi.json");
        }
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == generated,
            "docs/openapi.json is not the generated document: run SANDQ_WRITE_OPENAPI=1 cargo test -p sandq-gateway openapi"
        );
    }

    #[test]
    fn every_api_route_is_documented() {
        let document: serde_json::Value = serde_json::from_str(&super::json()).expect("JSON");
        assert_eq!(document["openapi"].as_str().map(|v| &v[..3]), Some("3.1"));
        let paths = document["paths"].as_object().expect("paths");
        for (path, methods) in [
            ("/v1/jobs", &["post"][..]),
            ("/v1/jobs/{id}", &["get", "delete"]),
            ("/v1/jobs/{id}/events", &["get"]),
            ("/v1/jobs/{id}/artifacts/{path}", &["get"]),
            ("/v1/jobs/{id}/outputs/{name}", &["get"]),
            ("/v1/jobs/{id}/logs/{stream}", &["get"]),
            ("/v1/files", &["post"]),
            ("/v1/sessions", &["get", "post"]),
            ("/v1/sessions/{name}", &["delete"]),
            ("/v1/sessions/{name}/files", &["get"]),
            ("/v1/sessions/{name}/files/{path}", &["get", "put", "delete"]),
        ] {
            for method in methods {
                assert!(paths.get(path).and_then(|p| p.get(*method)).is_some(), "{method} {path} is not documented");
            }
        }
    }
}
