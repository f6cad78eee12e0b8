//! [`OpenAiJson`], the JSON body extractor: like `axum::Json`, but every failure is an [`ApiError`] in the OpenAI
//! error body, with `param` naming the field whose value has the wrong type.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A request body parsed as JSON into `T`. Any `Content-Type` is accepted (clients such as `curl -d` send none
/// or a form type), since the body must parse as JSON anyway.
#[derive(Debug, Clone)]
pub struct OpenAiJson<T>(pub T);

impl<T, S> FromRequest<S> for OpenAiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(body_error)?;
        parse_json(&bytes).map(OpenAiJson)
    }
}

/// Parses `bytes` as a `T`: syntax errors name the line and column, type errors the field's path.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::InvalidRequest {
            message: "The request body is empty; expected a JSON object.".into(),
            param: None,
            code: None,
        });
    }
    // serde would also build a struct from a JSON array; OpenAI bodies are objects.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::InvalidRequest {
            message: "The request body must be a JSON object.".into(),
            param: None,
            code: Some("invalid_json"),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize::<_, T>(&mut de).map_err(|err| {
        let path = err.path().to_string();
        json_error(err.into_inner(), (path != ".").then_some(path))
    })?;
    de.end().map_err(|e| json_error(e, None))?;
    Ok(value)
}

fn json_error(err: serde_json::Error, param: Option<String>) -> ApiError {
    if err.is_data() {
        // serde reports a missing field at its parent; name the field itself.
        let missing = err
            .to_string()
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(field, _)| field.to_owned());
        let param = match (param, missing) {
            (Some(parent), Some(field)) => Some(format!("{parent}.{field}")),
            (None, Some(field)) => Some(field),
            (param, None) => param,
        };
        let message = match &param {
            Some(p) => format!("Invalid value for `{p}`: {err}"),
            None => format!("Invalid request body: {err}"),
        };
        ApiError::InvalidRequest { message, param, code: None }
    } else {
        ApiError::InvalidRequest {
            message: format!("The request body is not valid JSON: {err}"),
            param: None,
            code: Some("invalid_json"),
        }
    }
}

fn body_error(rejection: BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge
    } else {
        ApiError::InvalidRequest {
            message: format!("Could not read the request body: {}", rejection.body_text()),
            param: None,
            code: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ChatCompletionRequest;

    fn param_of(body: &str) -> (Option<String>, String) {
        match parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap_err() {
            ApiError::InvalidRequest { param, message, .. } => (param, message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn type_errors_name_the_field() {
        let (param, message) = param_of(r#"{"messages": [{"role": "user", "content": 5}]}"#);
        assert_eq!(param.as_deref(), Some("messages[0].content"), "{message}");
        let (param, _) = param_of(r#"{"messages": [], "temperature": "hot"}"#);
        assert_eq!(param.as_deref(), Some("temperature"));
        let (param, message) = param_of(r#"{"model": "m"}"#);
        assert_eq!(param.as_deref(), Some("messages"), "{message}");
        let (param, message) = param_of(r#"{"messages": [{"content": "x"}]}"#);
        assert_eq!(param.as_deref(), Some("messages[0].role"), "{message}");
    }

    #[test]
    fn syntax_errors_are_invalid_json() {
        for body in ["{", "{\"messages\": [}", "[1, 2", "[{\"role\": \"user\"}]", "{} x", "", "  ", "\"x\""] {
            let err = parse_json::<ChatCompletionRequest>(body.as_bytes()).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{body:?}");
        }
    }
}
