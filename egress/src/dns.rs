//! The sandbox's resolver: a query (parsed by hickory-proto) for an allowed name is
//! resolved by the host and answered with the addresses the [`AnswerFilter`] admits,
//! which become the name's pins; anything else is answered NXDOMAIN. Only IPv4 (A)
//! answers: sandboxes have no IPv6 route.

use std::net::Ipv4Addr;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{rdata::A, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinDecodable, BinEncodable};

use crate::rules::{AnswerFilter, Policy};

/// How long a sandbox may cache an answer. Short: pins are what the forwarder allows.
pub const ANSWER_TTL: u32 = 30;

/// What answering one query did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An allowed name, answered with these addresses (possibly none).
    Answered { name: String, addrs: Vec<Ipv4Addr> },
    /// A name no rule allows.
    Denied { name: String },
    /// Not a query this resolver answers (no question, several, not a standard query).
    Malformed,
}

/// Answers `query`: the response to send (none for bytes that are not a DNS query at
/// all) and what it did. `resolve` asks the host's resolver for a name's IPv4 addresses.
pub fn answer(
    query: &[u8],
    policy: &Policy,
    filter: &AnswerFilter,
    resolve: &mut dyn FnMut(&str) -> Vec<Ipv4Addr>,
) -> (Option<Vec<u8>>, Outcome) {
    let Ok(msg) = Message::from_bytes(query) else {
        return (None, Outcome::Malformed);
    };
    if msg.message_type() != MessageType::Query {
        return (None, Outcome::Malformed);
    }
    let mut resp = Message::new();
    resp.set_id(msg.id())
        .set_message_type(MessageType::Response)
        .set_op_code(msg.op_code())
        .set_recursion_desired(msg.recursion_desired())
        .set_recursion_available(true);
    let (question, outcome) = match (msg.op_code(), msg.queries()) {
        (OpCode::Query, [q]) => {
            let name = q
                .name()
                .to_ascii()
                .trim_end_matches('.')
                .to_ascii_lowercase();
            if policy.allows_name(&name) {
                let addrs: Vec<Ipv4Addr> = if q.query_type() == RecordType::A {
                    let mut a: Vec<Ipv4Addr> = resolve(&name)
                        .into_iter()
                        .filter(|a| filter.admits(*a))
                        .collect();
                    a.sort();
                    a.dedup();
                    a
                } else {
                    Vec::new()
                };
                for a in &addrs {
                    resp.add_answer(Record::from_rdata(
                        q.name().clone(),
                        ANSWER_TTL,
                        RData::A(A(*a)),
                    ));
                }
                resp.set_response_code(ResponseCode::NoError);
                (Some(q.clone()), Outcome::Answered { name, addrs })
            } else {
                resp.set_response_code(ResponseCode::NXDomain);
                (Some(q.clone()), Outcome::Denied { name })
            }
        }
        _ => {
            resp.set_response_code(ResponseCode::Refused);
            (None, Outcome::Malformed)
        }
    };
    if let Some(q) = question {
        resp.add_query(q);
    }
    (resp.to_bytes().ok(), outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use std::str::FromStr;

    fn query(name: &str, kind: RecordType) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(4242)
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(Name::from_str(name).unwrap(), kind));
        m.to_bytes().unwrap()
    }

    fn policy() -> Policy {
        Policy::of(&[("*.example.org", 443)]).unwrap()
    }

    #[test]
    fn allowed_names_get_the_admitted_answers_and_others_nxdomain() {
        let filter = AnswerFilter::default();
        let mut asked = Vec::new();
        let mut resolve = |n: &str| {
            asked.push(n.to_string());
            vec![Ipv4Addr::new(93, 184, 216, 34), Ipv4Addr::new(127, 0, 0, 1)]
        };
        let (bytes, outcome) = answer(
            &query("WWW.example.org.", RecordType::A),
            &policy(),
            &filter,
            &mut resolve,
        );
        assert_eq!(
            outcome,
            Outcome::Answered {
                name: "www.example.org".into(),
                addrs: vec![Ipv4Addr::new(93, 184, 216, 34)]
            }
        );
        let resp = Message::from_bytes(&bytes.unwrap()).unwrap();
        assert_eq!(resp.id(), 4242);
        assert_eq!(resp.response_code(), ResponseCode::NoError);
        assert_eq!(resp.answers().len(), 1, "the loopback answer was given");
        let (bytes, outcome) = answer(
            &query("evil.net.", RecordType::A),
            &policy(),
            &filter,
            &mut resolve,
        );
        assert_eq!(
            outcome,
            Outcome::Denied {
                name: "evil.net".into()
            }
        );
        let resp = Message::from_bytes(&bytes.unwrap()).unwrap();
        assert_eq!(resp.response_code(), ResponseCode::NXDomain);
        assert!(resp.answers().is_empty());
        assert_eq!(
            asked,
            vec!["www.example.org".to_string()],
            "a denied name was resolved"
        );
        // IPv6 questions for an allowed name: no answers, no lookup.
        let (_, outcome) = answer(
            &query("a.example.org.", RecordType::AAAA),
            &policy(),
            &filter,
            &mut |_| panic!("looked up"),
        );
        assert!(matches!(outcome, Outcome::Answered { addrs, .. } if addrs.is_empty()));
        assert_eq!(
            answer(b"\x00\x01garbage", &policy(), &filter, &mut |_| vec![]).1,
            Outcome::Malformed
        );
    }
}
