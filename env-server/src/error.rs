//! The API's error answer: a status and `{error: {code, message}}`, and how each module's
//! errors map to it.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use env_api::{error_chain, ErrorBody, ErrorDetail, FieldTooLong};

use crate::episode::EpisodeError;
use crate::evaluation::EvalError;

/// An error answer: status plus `{error: {code, message}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.into(),
                message: self.message,
            },
        };
        let mut resp = (self.status, Json(body)).into_response();
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        resp
    }
}

impl From<EpisodeError> for ApiError {
    fn from(e: EpisodeError) -> Self {
        // The client gets the error with its causes: they are sources, not in the message.
        let msg = error_chain(&e);
        match e {
            EpisodeError::Unknown(_) => Self::new(StatusCode::NOT_FOUND, "unknown_episode", msg),
            EpisodeError::Task(kernelbench::TaskError::Unknown(_))
            | EpisodeError::Task(kernelbench::TaskError::EmptySplit(_)) => {
                Self::new(StatusCode::NOT_FOUND, "unknown_task", msg)
            }
            EpisodeError::Task(_) => Self::new(StatusCode::BAD_REQUEST, "bad_task", msg),
            EpisodeError::Call(agent_tools::CallError::UnknownTool { .. }) => {
                Self::new(StatusCode::BAD_REQUEST, "unknown_tool", msg)
            }
            EpisodeError::Call(_) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "bad_arguments", msg)
            }
            EpisodeError::Ended(_) => Self::new(StatusCode::CONFLICT, "episode_ended", msg),
            EpisodeError::AtCapacity(_) | EpisodeError::Exhausted(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "at_capacity", msg)
            }
            EpisodeError::HostBusy(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "host_busy", msg)
            }
            EpisodeError::BadRequest(_) => Self::new(StatusCode::BAD_REQUEST, "bad_request", msg),
            EpisodeError::Draining(e) => e.into(),
            EpisodeError::KeyReused(e) => e.into(),
            EpisodeError::Internal { .. } => {
                tracing::error!(error = %msg, "episode request failed inside the server");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", msg)
            }
        }
    }
}

impl From<crate::idempotency::KeyReused> for ApiError {
    fn from(e: crate::idempotency::KeyReused) -> Self {
        Self::new(StatusCode::CONFLICT, "request_id_reused", e.to_string())
    }
}

impl From<crate::drain::Draining> for ApiError {
    fn from(e: crate::drain::Draining) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "draining", e.to_string())
    }
}

impl From<FieldTooLong> for ApiError {
    fn from(e: FieldTooLong) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "field_too_long", e.to_string())
    }
}

impl From<EvalError> for ApiError {
    fn from(e: EvalError) -> Self {
        // The client gets the error with its causes: they are sources, not in the message.
        let msg = error_chain(&e);
        match e {
            EvalError::BadSolution(_) => Self::new(StatusCode::BAD_REQUEST, "bad_solution", msg),
            EvalError::QueueFull(_) => Self::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", msg),
            _ => {
                // The operator's only record of it: the client may not keep the body.
                tracing::error!(error = %msg, "evaluation failed in the harness");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "harness_error", msg)
            }
        }
    }
}
