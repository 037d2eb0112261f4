//! The service's errors, and how each becomes a gRPC status: the code a client branches
//! on, a message that names the thing and the fix, and the machine-readable reason in the
//! `strata-reason` metadata (with `retry-after`, in seconds, when waiting helps).

use std::time::Duration;

use strata_runtime::RuntimeError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    NotFound(String),
    /// A field of the request is wrong; `field` names it.
    #[error("{field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("{0}")]
    AlreadyExists(String),
    /// Over a project's quota or the node's capacity; `reason` says which.
    #[error("{message}")]
    Exhausted {
        reason: &'static str,
        message: String,
        retry_after: Duration,
    },
    #[error("{0}")]
    Unavailable(String),
    /// The request cannot be answered in the state things are in (a journal step that
    /// failed or was cut off).
    #[error("{0}")]
    FailedPrecondition(String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Catalog(#[from] strata_catalog::CatalogError),
    #[error(transparent)]
    Store(#[from] strata_store::StoreError),
    #[error("store object `{key}`: {source}")]
    Backend {
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error("store object `{key}` is not valid: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("internal: {0}")]
    Internal(String),
}

impl ServiceError {
    pub fn invalid(field: &str, message: impl Into<String>) -> ServiceError {
        ServiceError::InvalidArgument {
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// The gRPC code and the machine-readable reason.
    pub fn code_and_reason(&self) -> (Code, &'static str) {
        use strata_catalog::CatalogError as C;
        match self {
            ServiceError::Unauthenticated(_) => (Code::Unauthenticated, "unauthenticated"),
            ServiceError::PermissionDenied(_) => (Code::PermissionDenied, "permission-denied"),
            ServiceError::NotFound(_) => (Code::NotFound, "not-found"),
            ServiceError::InvalidArgument { .. } => (Code::InvalidArgument, "invalid-argument"),
            ServiceError::AlreadyExists(_) => (Code::AlreadyExists, "already-exists"),
            ServiceError::Exhausted { reason, .. } => (Code::ResourceExhausted, reason),
            ServiceError::Unavailable(_) => (Code::Unavailable, "unavailable"),
            ServiceError::FailedPrecondition(_) => {
                (Code::FailedPrecondition, "failed-precondition")
            }
            ServiceError::Runtime(e) => match e {
                RuntimeError::NotFound(_) => (Code::NotFound, "not-found"),
                RuntimeError::Invalid(_) | RuntimeError::Unsupported(_) => {
                    (Code::InvalidArgument, "invalid-argument")
                }
                RuntimeError::File { source, .. } => match source.kind() {
                    std::io::ErrorKind::NotFound => (Code::NotFound, "not-found"),
                    std::io::ErrorKind::PermissionDenied => {
                        (Code::PermissionDenied, "permission-denied")
                    }
                    _ => (Code::InvalidArgument, "invalid-argument"),
                },
                RuntimeError::Quota(_) => (Code::ResourceExhausted, "disk"),
                RuntimeError::Busy(_) => (Code::FailedPrecondition, "busy"),
                _ => (Code::Internal, "internal"),
            },
            ServiceError::Catalog(e) => match e {
                C::NotFound(_) | C::Removed { .. } | C::AllRemoved(_) => {
                    (Code::NotFound, "not-found")
                }
                C::Invalid(_) | C::MissingLayer { .. } => {
                    (Code::InvalidArgument, "invalid-argument")
                }
                C::VersionExists { .. } => (Code::AlreadyExists, "already-exists"),
                C::Contended(_) => (Code::Unavailable, "unavailable"),
                C::Store(s) => store_code(s),
                C::Backend { .. } => (Code::Unavailable, "store"),
                _ => (Code::Internal, "internal"),
            },
            ServiceError::Store(s) => store_code(s),
            ServiceError::Backend { .. } => (Code::Unavailable, "store"),
            ServiceError::Corrupt { .. } | ServiceError::Io { .. } | ServiceError::Internal(_) => {
                (Code::Internal, "internal")
            }
        }
    }

    /// Whether the store failed (counted in the metrics).
    pub fn is_store(&self) -> bool {
        matches!(self.code_and_reason().1, "store")
    }
}

fn store_code(e: &strata_store::StoreError) -> (Code, &'static str) {
    use strata_store::StoreError as S;
    match e {
        S::LayerNotFound(_) | S::Missing { .. } => (Code::NotFound, "not-found"),
        S::AmbiguousLayer { .. } | S::AmbiguousLayerName { .. } | S::Url { .. } => {
            (Code::InvalidArgument, "invalid-argument")
        }
        S::Busy(_) => (Code::Unavailable, "busy"),
        S::Corrupt { .. } | S::Manifest { .. } | S::Json { .. } => (Code::DataLoss, "corrupt"),
        _ => (Code::Unavailable, "store"),
    }
}

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Status {
        let (code, reason) = e.code_and_reason();
        let mut status = Status::new(code, e.to_string());
        let md = status.metadata_mut();
        if let Ok(v) = reason.parse() {
            md.insert("strata-reason", v);
        }
        if let ServiceError::InvalidArgument { field, .. } = &e {
            if let Ok(v) = field.parse() {
                md.insert("strata-field", v);
            }
        }
        if let ServiceError::Exhausted { retry_after, .. } = &e {
            if let Ok(v) = retry_after.as_secs().max(1).to_string().parse() {
                md.insert("retry-after", v);
            }
        }
        status
    }
}
