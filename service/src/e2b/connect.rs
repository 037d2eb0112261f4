//! The Connect protocol as envd's clients speak it: JSON messages, unary replies and
//! errors, and the enveloped frames of streams (a flags byte, a big-endian length, the
//! message; flag 2 ends the stream). Frames from a client are parsed incrementally with
//! a size bound; field names are accepted in camelCase and snake_case, numbers as JSON
//! numbers or strings, as proto3's JSON mapping allows.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use serde_json::Value;

use crate::error::ServiceError;

/// The content type of a streamed reply, exactly (a parameter breaks connectrpc).
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";

/// The largest message taken from a client.
pub const MAX_MESSAGE: usize = 4 << 20;

const END_STREAM: u8 = 0x02;
const COMPRESSED: u8 = 0x01;

/// A Connect error code and its message.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcError {
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new("invalid_argument", message)
    }

    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new("not_found", message)
    }

    /// The HTTP status of this error on a unary call (Connect's table).
    pub fn http_status(&self) -> StatusCode {
        match self.code {
            "canceled" => StatusCode::from_u16(499).unwrap_or(StatusCode::REQUEST_TIMEOUT),
            "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "permission_denied" => StatusCode::FORBIDDEN,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::json!({"code": self.code, "message": self.message})
    }

    /// A unary call's error reply.
    pub fn unary(&self) -> Response {
        (
            self.http_status(),
            [("content-type", "application/json")],
            self.json().to_string(),
        )
            .into_response()
    }
}

impl From<ServiceError> for RpcError {
    fn from(e: ServiceError) -> RpcError {
        use tonic::Code;
        let code = match e.code_and_reason().0 {
            Code::Cancelled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
            _ => "internal",
        };
        RpcError::new(code, e.to_string())
    }
}

/// A unary call's successful reply.
pub fn unary_ok(v: Value) -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// One message frame.
pub fn frame(v: &Value) -> Bytes {
    envelope(0, v.to_string().as_bytes())
}

/// The frame that ends a stream, with the error that ended it if one did.
pub fn end_frame(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.json()}),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.extend_from_slice(&[flags]);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.freeze()
}

/// Splits a client's enveloped stream into messages as bytes arrive.
#[derive(Default)]
pub struct Deframer {
    buf: BytesMut,
    ended: bool,
}

impl Deframer {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole message, `Ok(None)` when more bytes are needed (or the client sent
    /// its end frame).
    pub fn next_message(&mut self) -> Result<Option<Value>, RpcError> {
        if self.ended || self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(RpcError::new(
                "resource_exhausted",
                format!("a message of {len} bytes is over the limit of {MAX_MESSAGE}"),
            ));
        }
        if flags & COMPRESSED != 0 {
            return Err(RpcError::new(
                "internal",
                "compressed messages are not accepted: send Connect-Content-Encoding: identity",
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len);
        if flags & END_STREAM != 0 {
            self.ended = true;
            return Ok(None);
        }
        let v = serde_json::from_slice(&payload)
            .map_err(|e| RpcError::invalid(format!("the message is not JSON: {e}")))?;
        Ok(Some(v))
    }

    /// Bytes are held for a message not complete yet.
    pub fn pending(&self) -> bool {
        !self.buf.is_empty()
    }
}

/// The value of a field given in either of proto3 JSON's spellings.
pub fn field<'a>(v: &'a Value, camel: &str, snake: &str) -> Option<&'a Value> {
    v.get(camel)
        .or_else(|| v.get(snake))
        .filter(|v| !v.is_null())
}

pub fn text(v: &Value, name: &str) -> Option<String> {
    v.get(name).and_then(Value::as_str).map(str::to_string)
}

/// An integer given as a number or a string.
pub fn int(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

pub fn boolean(v: Option<&Value>) -> Option<bool> {
    v.and_then(Value::as_bool)
}

/// A `map<string, string>` field.
pub fn string_map(v: Option<&Value>) -> std::collections::BTreeMap<String, String> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// A `bytes` field: base64, padded or not, standard or URL alphabet.
pub fn bytes_field(v: Option<&Value>) -> Result<Vec<u8>, RpcError> {
    use base64::Engine;
    let Some(s) = v.and_then(Value::as_str) else {
        return Ok(Vec::new());
    };
    let t = s.trim_end_matches('=');
    base64::engine::general_purpose::STANDARD_NO_PAD
        .decode(t)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(t))
        .map_err(|e| RpcError::invalid(format!("bytes are not base64: {e}")))
}

pub fn b64(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_in_any_split() {
        let a = frame(&serde_json::json!({"start": {"process": {"pid": 7}}}));
        let b = frame(&serde_json::json!({"data": {"input": {"stdin": "aGk="}}}));
        let end = end_frame(None);
        let all: Vec<u8> = [a.as_ref(), b.as_ref(), end.as_ref()].concat();
        for split in 0..all.len() {
            let mut d = Deframer::default();
            let mut got = Vec::new();
            d.push(&all[..split]);
            while let Some(v) = d.next_message().unwrap() {
                got.push(v);
            }
            d.push(&all[split..]);
            while let Some(v) = d.next_message().unwrap() {
                got.push(v);
            }
            assert_eq!(got.len(), 2, "split at {split}");
            assert_eq!(int(got[0]["start"]["process"].get("pid")), Some(7));
            assert_eq!(
                bytes_field(got[1]["data"]["input"].get("stdin")).unwrap(),
                b"hi"
            );
        }
    }

    #[test]
    fn refuses_oversized_and_compressed_frames() {
        let mut d = Deframer::default();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next_message().unwrap_err().code, "resource_exhausted");
        let mut d = Deframer::default();
        d.push(&[1, 0, 0, 0, 2, b'{', b'}']);
        assert!(d.next_message().is_err());
        let mut d = Deframer::default();
        d.push(&[0, 0, 0, 0, 3, b'{', b'x', b'}']);
        assert_eq!(d.next_message().unwrap_err().code, "invalid_argument");
    }

    #[test]
    fn reads_proto3_json_leniently() {
        let v = serde_json::json!({"watcher_id": "w", "depth": "3", "pid": 4});
        assert_eq!(
            field(&v, "watcherId", "watcher_id").and_then(Value::as_str),
            Some("w")
        );
        assert_eq!(int(v.get("depth")), Some(3));
        assert_eq!(int(v.get("pid")), Some(4));
        assert_eq!(bytes_field(Some(&serde_json::json!("aGk"))).unwrap(), b"hi");
        assert_eq!(end_frame(None)[0], 2);
    }
}
