//! Idempotency keys of resets and evaluations: a client that lost an answer (a connection
//! cut, a server that went away while it failed over) sends the same `request_id` again, and
//! must never get a second episode or pay for a second evaluation.
//!
//! [`Keys`] is the bounded map both use: the most recent keys, each with what it stands for
//! (a reset's episode id, an evaluation running or its verdict). The oldest are forgotten
//! beyond the cap, so a client sending endless fresh keys cannot grow the server's memory.

use std::collections::{HashMap, VecDeque};

/// A request body without its key, as a digest. A key names one request: sent again with
/// another body (a client's bug, or keys reused across runs) it is refused, never answered
/// with what the first body got — an evaluation's verdict must be its own solution's.
pub type BodyDigest = [u8; 32];

/// The digest of `body` (its JSON form: the wire types hold no unordered maps).
pub fn body_digest<T: serde::Serialize>(body: &T) -> BodyDigest {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    crate::build::digest_parts([bytes.as_slice()])
}

/// A key sent again with another body.
#[derive(Debug, thiserror::Error)]
#[error("request_id {0:?} was already used for a different request; use a fresh key for new work")]
pub struct KeyReused(pub String);

/// The most recent keys and their values, at most `cap` of them.
#[derive(Debug)]
pub struct Keys<V> {
    cap: usize,
    /// Each key's value, with the sequence number of its insertion.
    map: HashMap<String, (u64, V)>,
    /// Insertion order; an entry whose sequence number no longer matches the map's (the key
    /// was removed or inserted again) is skipped when it comes up.
    order: VecDeque<(u64, String)>,
    seq: u64,
}

impl<V: Clone> Keys<V> {
    /// An empty map that remembers at most `cap` keys.
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
            seq: 0,
        }
    }

    /// The value of `key`, if it is remembered.
    pub fn get(&self, key: &str) -> Option<V> {
        self.map.get(key).map(|(_, v)| v.clone())
    }

    /// Remembers `value` for `key` (replacing what it had), forgetting the oldest keys
    /// beyond the cap.
    pub fn insert(&mut self, key: &str, value: V) {
        self.seq += 1;
        self.map.insert(key.to_string(), (self.seq, value));
        self.order.push_back((self.seq, key.to_string()));
        // Stale order entries (keys removed since) count too, so the queue stays bounded
        // even when most keys are removed again (requests that failed).
        while self.map.len() > self.cap || self.order.len() > 2 * self.cap {
            let Some((seq, k)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|(s, _)| *s == seq) {
                self.map.remove(&k);
            }
        }
    }

    /// Forgets `key` if `pred` holds for its value.
    pub fn remove_if(&mut self, key: &str, pred: impl FnOnce(&V) -> bool) {
        if self.map.get(key).is_some_and(|(_, v)| pred(v)) {
            self.map.remove(key);
        }
    }

    /// Keys remembered.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_differ_by_digest_and_keys_are_left_out_by_the_caller() {
        #[derive(serde::Serialize)]
        struct Body<'a> {
            solution: &'a str,
            request_id: Option<&'a str>,
        }
        let a = body_digest(&Body {
            solution: "a",
            request_id: None,
        });
        assert_eq!(
            a,
            body_digest(&Body {
                solution: "a",
                request_id: None
            })
        );
        assert_ne!(
            a,
            body_digest(&Body {
                solution: "b",
                request_id: None
            })
        );
    }

    #[test]
    fn the_oldest_keys_are_forgotten_beyond_the_cap() {
        let mut k = Keys::new(3);
        for i in 0..5 {
            k.insert(&format!("k{i}"), i);
        }
        assert_eq!(k.len(), 3);
        assert_eq!(k.get("k0"), None);
        assert_eq!(k.get("k1"), None);
        assert_eq!(k.get("k4"), Some(4));
        // A key inserted again counts from its new insertion.
        k.insert("k2", 20);
        k.insert("k5", 5);
        assert_eq!(k.get("k2"), Some(20));
        assert_eq!(k.get("k3"), None);
    }

    #[test]
    fn removed_keys_do_not_grow_the_queue() {
        let mut k = Keys::new(4);
        for i in 0..1000 {
            let key = format!("k{i}");
            k.insert(&key, i);
            k.remove_if(&key, |_| true);
        }
        assert!(k.is_empty());
        assert!(k.order.len() <= 8, "{} stale entries", k.order.len());
        k.insert("a", 1);
        k.remove_if("a", |v| *v == 2);
        assert_eq!(k.get("a"), Some(1), "kept: the predicate did not hold");
    }
}
