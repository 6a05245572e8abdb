//! Errors as E2B's API sends them: a status and a JSON body `{code, message}` whose
//! `code` repeats the status. [`ApiError::from_sandbox`] is the one place where Cube's
//! failures become statuses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use cube_agent::client::ClientError;
use cube_agent::protocol::ErrorCode;
use cube_core::SandboxError;

/// A failed API call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for people.
    pub message: String,
}

impl ApiError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404: no such sandbox (or snapshot, template, file).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// 409: the sandbox's state does not allow it.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// The status for a failure of the sandbox engine. Kept in one function so that
    /// it can switch to cube-core's typed error kinds in one place.
    pub fn from_sandbox(err: &SandboxError) -> Self {
        use SandboxError as E;
        let status = match err {
            E::UnknownSandbox(_) | E::UnknownTemplate(_) | E::UnknownSnapshot(_) => {
                StatusCode::NOT_FOUND
            }
            E::TemplateExists(_) | E::TemplateInUse { .. } | E::Hibernated(_) => {
                StatusCode::CONFLICT
            }
            E::NotOwner { .. } | E::EngineMismatch { .. } | E::BuiltInTemplate(_) => {
                StatusCode::BAD_REQUEST
            }
            E::NoAgent(_) => StatusCode::NOT_IMPLEMENTED,
            E::Agent(_, source) => return Self::from_agent(source),
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, error_chain(err))
    }

    /// The status for a failure reported by a sandbox's agent.
    pub fn from_agent(err: &ClientError) -> Self {
        let status = match err {
            ClientError::Agent(reply) => match reply.code {
                ErrorCode::NotFound | ErrorCode::NoSuchExec | ErrorCode::NoSuchContext => {
                    StatusCode::NOT_FOUND
                }
                ErrorCode::InvalidArgument
                | ErrorCode::NotADirectory
                | ErrorCode::IsADirectory
                | ErrorCode::Malformed => StatusCode::BAD_REQUEST,
                ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
                ErrorCode::AlreadyExists | ErrorCode::NotEmpty | ErrorCode::NotRunning => {
                    StatusCode::CONFLICT
                }
                ErrorCode::Busy => StatusCode::TOO_MANY_REQUESTS,
                ErrorCode::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ClientError::Connect(_) | ClientError::Disconnected | ClientError::Timeout => {
                StatusCode::BAD_GATEWAY
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let message = match err {
            ClientError::Agent(reply) => reply.message.clone(),
            other => error_chain(other),
        };
        Self::new(status, message)
    }
}

/// An error's message followed by those of its sources.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "code": self.status.as_u16(),
            "message": self.message,
        });
        (self.status, axum::Json(body)).into_response()
    }
}

impl From<SandboxError> for ApiError {
    fn from(err: SandboxError) -> Self {
        Self::from_sandbox(&err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_failures_get_e2b_statuses() {
        let e = ApiError::from_sandbox(&SandboxError::UnknownSandbox("sb-1".into()));
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert!(e.message.contains("sb-1"));
        let e = ApiError::from_sandbox(&SandboxError::Hibernated("sb-1".into()));
        assert_eq!(e.status, StatusCode::CONFLICT);
        let e = ApiError::from_agent(&ClientError::Agent(cube_agent::protocol::ErrorReply::new(
            ErrorCode::NotFound,
            "no file /x",
        )));
        assert_eq!(
            (e.status, e.message.as_str()),
            (StatusCode::NOT_FOUND, "no file /x")
        );
        assert_eq!(
            ApiError::from_agent(&ClientError::Disconnected).status,
            StatusCode::BAD_GATEWAY
        );
    }
}
