//! A client of several servers: a list of URLs, or a DNS name that resolves to many (a
//! Kubernetes headless Service), re-resolved as the fleet changes.
//!
//! New work (a reset, an evaluation) goes to the servers in turn. One that is gone
//! (connection refused), draining (503 `draining`/`drained`) or full (503 `at_capacity`,
//! `host_busy`, `busy`, 429 `queue_full`) is skipped and the request sent to another with the
//! same `request_id`, so a server that did get it answers a retry with its first answer
//! instead of starting a second episode or evaluation. An answer lost on the way (a
//! connection cut mid-request) is asked again of the same server first, with the same key.
//!
//! An episode stays on its server ([`ServerHandle`]): a step that finds its server gone or
//! draining ends the episode, and [`ClientError::is_server_gone`] tells that loss apart from
//! a failure.

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use env_api::{EvaluateRequest, EvaluationResult, ResetRequest, ResetResponse};

use crate::{new_request_id, ClientError, EnvClient};

/// The URL scheme that asks for every address of a name: `dns+http://NAME:PORT`.
pub const DNS_SCHEME: &str = "dns+http://";

/// Errors of the fleet.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// A URL could not be used.
    #[error("bad server URL {url:?}: {why}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// A name did not resolve, and no address of it was known before.
    #[error("resolving {name}")]
    Resolve {
        /// `host:port`.
        name: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP client for a server could not be built.
    #[error("HTTP client for {url}")]
    Client {
        /// The server's URL.
        url: String,
        /// The client's error.
        #[source]
        source: ClientError,
    },
    /// No server is known (every name resolved to nothing).
    #[error("no server to send the request to")]
    NoServer,
    /// The request failed on the last server tried.
    #[error("{server}")]
    Server {
        /// That server's base URL.
        server: String,
        /// How it failed.
        #[source]
        source: ClientError,
    },
}

impl FleetError {
    /// The server's error, if one answered or was reached.
    pub fn client_error(&self) -> Option<&ClientError> {
        match self {
            FleetError::Server { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// How a fleet is reached.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Base URLs (`http://10.0.0.5:8080`) and names to resolve (`dns+http://envs:8080`).
    pub urls: Vec<String>,
    /// Bearer key, if the servers want one.
    pub api_key: Option<String>,
    /// Per-request timeout (it must cover an evaluation).
    pub timeout: Duration,
    /// Retries of a step on its own server.
    pub retries: u32,
    /// How often names are resolved again.
    pub resolve_every: Duration,
    /// How long a server that refused a connection or drains is passed over for new work.
    pub down_for: Duration,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            api_key: None,
            timeout: Duration::from_secs(900),
            retries: 3,
            resolve_every: Duration::from_secs(30),
            down_for: Duration::from_secs(10),
        }
    }
}

/// One server of the fleet.
#[derive(Debug)]
pub struct Server {
    client: EnvClient,
    /// Passed over for new work until then.
    down_until: Mutex<Option<Instant>>,
}

/// A server an episode lives on: its steps, state and close go there.
pub type ServerHandle = Arc<Server>;

impl Server {
    /// Its base URL.
    pub fn base(&self) -> &str {
        self.client.base()
    }

    /// Its client.
    pub fn client(&self) -> &EnvClient {
        &self.client
    }

    fn is_down(&self, now: Instant) -> bool {
        self.down_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| t > now)
    }

    fn mark_down(&self, down_for: Duration) {
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + down_for);
    }
}

/// Where servers come from.
#[derive(Debug, Clone)]
enum Source {
    /// One server.
    Url(String),
    /// Every address of `host:port`.
    Name { host: String, port: u16 },
}

/// The servers, with new work spread over them and moved off servers that went away.
#[derive(Debug, Clone)]
pub struct Fleet {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    cfg: FleetConfig,
    sources: Vec<Source>,
    servers: Mutex<Vec<ServerHandle>>,
    next: AtomicUsize,
    /// When names were last resolved; held while resolving, so one caller does it.
    resolved_at: tokio::sync::Mutex<Option<Instant>>,
}

impl Fleet {
    /// A fleet of `cfg.urls`; names are resolved on first use.
    pub fn new(cfg: FleetConfig) -> Result<Self, FleetError> {
        if cfg.urls.is_empty() {
            return Err(FleetError::NoServer);
        }
        let sources = cfg
            .urls
            .iter()
            .map(|u| parse_source(u))
            .collect::<Result<Vec<_>, _>>()?;
        let mut servers = Vec::new();
        for s in &sources {
            if let Source::Url(u) = s {
                servers.push(server(&cfg, u)?);
            }
        }
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                sources,
                servers: Mutex::new(servers),
                next: AtomicUsize::new(0),
                resolved_at: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// The servers known now (resolving names first when due).
    pub async fn servers(&self) -> Result<Vec<ServerHandle>, FleetError> {
        self.refresh().await?;
        Ok(self.snapshot())
    }

    fn snapshot(&self) -> Vec<ServerHandle> {
        self.inner
            .servers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Resolves the names again when `resolve_every` has passed. A server that left the
    /// name's records gets no new work; its episodes keep their handles. A failed resolution
    /// keeps the addresses known before.
    async fn refresh(&self) -> Result<(), FleetError> {
        let names: Vec<(String, u16)> = self
            .inner
            .sources
            .iter()
            .filter_map(|s| match s {
                Source::Name { host, port } => Some((host.clone(), *port)),
                Source::Url(_) => None,
            })
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        let mut at = self.inner.resolved_at.lock().await;
        if at.is_some_and(|t| t.elapsed() < self.inner.cfg.resolve_every) {
            return Ok(());
        }
        let mut addrs: Vec<SocketAddr> = Vec::new();
        let mut failure = None;
        for (host, port) in &names {
            match tokio::net::lookup_host((host.as_str(), *port)).await {
                Ok(found) => addrs.extend(found),
                Err(source) => {
                    failure = Some(FleetError::Resolve {
                        name: format!("{host}:{port}"),
                        source,
                    })
                }
            }
        }
        addrs.sort();
        addrs.dedup();
        let known = self.snapshot();
        if let Some(e) = failure {
            if known.is_empty() && addrs.is_empty() {
                return Err(e);
            }
        }
        let mut next: Vec<ServerHandle> = Vec::new();
        for s in &self.inner.sources {
            if let Source::Url(u) = s {
                if let Some(k) = known.iter().find(|k| k.base() == trim(u)) {
                    next.push(k.clone());
                }
            }
        }
        let resolved_any = !addrs.is_empty();
        for a in addrs {
            let base = format!("http://{a}");
            match known.iter().find(|k| k.base() == base) {
                Some(k) => next.push(k.clone()),
                None => next.push(server(&self.inner.cfg, &base)?),
            }
        }
        if !resolved_any {
            // Keep the addresses known before rather than go empty on one bad answer.
            let kept: Vec<ServerHandle> = known
                .iter()
                .filter(|k| !next.iter().any(|n| n.base() == k.base()))
                .cloned()
                .collect();
            next.extend(kept);
        }
        *self.inner.servers.lock().unwrap_or_else(|e| e.into_inner()) = next;
        *at = Some(Instant::now());
        Ok(())
    }

    /// The next server for new work, round robin: one not yet `tried` and not passed over,
    /// else one not yet tried.
    fn pick(&self, tried: &HashSet<String>) -> Option<ServerHandle> {
        let servers = self.snapshot();
        let now = Instant::now();
        let n = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let fresh: Vec<&ServerHandle> = servers
            .iter()
            .filter(|s| !tried.contains(s.base()))
            .collect();
        let up: Vec<&ServerHandle> = fresh.iter().copied().filter(|s| !s.is_down(now)).collect();
        let from = if up.is_empty() { fresh } else { up };
        (!from.is_empty()).then(|| from[n % from.len()].clone())
    }

    /// Starts an episode on some server; the answer comes with the server it lives on. The
    /// reset carries a `request_id` (one is made when absent) that every server tried sees.
    pub async fn reset(
        &self,
        req: &ResetRequest,
    ) -> Result<(ServerHandle, ResetResponse), FleetError> {
        let mut req = req.clone();
        req.request_id.get_or_insert_with(new_request_id);
        let req = &req;
        self.failover(|c| async move { c.reset(req).await }).await
    }

    /// Evaluates a solution on some server, failing over like [`Fleet::reset`]; the key goes
    /// in `options.request_id`.
    pub async fn evaluate(&self, req: &EvaluateRequest) -> Result<EvaluationResult, FleetError> {
        let mut req = req.clone();
        req.options
            .get_or_insert_with(Default::default)
            .request_id
            .get_or_insert_with(new_request_id);
        let req = &req;
        self.failover(|c| async move { c.evaluate(req).await })
            .await
            .map(|(_, r)| r)
    }

    /// Runs `call` on servers in turn until one answers or fails in a way another server
    /// would not mend.
    async fn failover<T, F, Fut>(&self, call: F) -> Result<(ServerHandle, T), FleetError>
    where
        F: Fn(EnvClient) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        self.refresh().await?;
        let mut tried = HashSet::new();
        let mut again: Option<ServerHandle> = None;
        let mut asked_again = 0;
        let mut last = None;
        loop {
            let server = match again.take() {
                Some(s) => s,
                None => match self.pick(&tried) {
                    Some(s) => s,
                    None => break,
                },
            };
            match call(server.client.clone()).await {
                Ok(v) => return Ok((server, v)),
                Err(e) => {
                    if e.is_server_gone() && !e.is_lost_answer() {
                        server.mark_down(self.inner.cfg.down_for);
                    } else if e.is_lost_answer() && asked_again < self.inner.cfg.retries {
                        // It may have started the work: ask it again, under the same key.
                        asked_again += 1;
                        again = Some(server.clone());
                        tokio::time::sleep(Duration::from_millis(100 << asked_again.min(5))).await;
                        last = Some((server, e));
                        continue;
                    } else if !e.is_full() {
                        return Err(FleetError::Server {
                            server: server.base().to_string(),
                            source: e,
                        });
                    }
                    tried.insert(server.base().to_string());
                    last = Some((server, e));
                }
            }
        }
        Err(match last {
            Some((server, source)) => FleetError::Server {
                server: server.base().to_string(),
                source,
            },
            None => FleetError::NoServer,
        })
    }
}

fn trim(u: &str) -> &str {
    u.trim_end_matches('/')
}

fn server(cfg: &FleetConfig, base: &str) -> Result<ServerHandle, FleetError> {
    let client = EnvClient::new(base, cfg.timeout)
        .map_err(|source| FleetError::Client {
            url: base.to_string(),
            source,
        })?
        .with_retries(cfg.retries);
    let client = match &cfg.api_key {
        Some(k) => client.with_api_key(k.clone()),
        None => client,
    };
    Ok(Arc::new(Server {
        client,
        down_until: Mutex::new(None),
    }))
}

fn parse_source(url: &str) -> Result<Source, FleetError> {
    let bad = |why: &str| FleetError::BadUrl {
        url: url.to_string(),
        why: why.to_string(),
    };
    let Some(rest) = url.strip_prefix(DNS_SCHEME) else {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(bad("expected http://, https:// or dns+http://"));
        }
        return Ok(Source::Url(trim(url).to_string()));
    };
    let authority = trim(rest);
    if authority.contains('/') {
        return Err(bad("a dns+http URL names a host and port only"));
    }
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| bad("a dns+http URL needs a port"))?;
    let port = port.parse().map_err(|_| bad("the port is not a number"))?;
    if host.is_empty() {
        return Err(bad("no host name"));
    }
    Ok(Source::Name {
        host: host.to_string(),
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_names_are_told_apart() {
        assert!(matches!(
            parse_source("http://10.0.0.1:8080/").unwrap(),
            Source::Url(u) if u == "http://10.0.0.1:8080"
        ));
        assert!(matches!(
            parse_source("dns+http://envs.ns.svc:8080").unwrap(),
            Source::Name { host, port: 8080 } if host == "envs.ns.svc"
        ));
        for bad in [
            "envs:8080",
            "dns+http://envs",
            "dns+http://envs:x",
            "dns+http://e:1/v1",
        ] {
            assert!(parse_source(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_name_becomes_one_server_per_address_and_keeps_its_servers() {
        let fleet = Fleet::new(FleetConfig {
            urls: vec!["dns+http://localhost:9".into(), "http://127.0.0.2:9".into()],
            resolve_every: Duration::ZERO,
            ..Default::default()
        })
        .unwrap();
        let first = fleet.servers().await.unwrap();
        let bases: Vec<&str> = first.iter().map(|s| s.base()).collect();
        assert!(bases.contains(&"http://127.0.0.1:9"), "{bases:?}");
        assert!(bases.contains(&"http://127.0.0.2:9"), "{bases:?}");
        first[0].mark_down(Duration::from_secs(60));
        let again = fleet.servers().await.unwrap();
        assert!(
            Arc::ptr_eq(&first[0], &again[0]),
            "a server resolved again is the same server, its down mark kept"
        );
        assert!(again[0].is_down(Instant::now()));
    }

    #[tokio::test]
    async fn new_work_skips_a_refusing_server_and_says_so_when_none_is_left() {
        // Ports nobody listens on: every connection is refused.
        let fleet = Fleet::new(FleetConfig {
            urls: vec!["http://127.0.0.1:9".into(), "http://127.0.0.1:19".into()],
            timeout: Duration::from_secs(5),
            ..Default::default()
        })
        .unwrap();
        let err = fleet.reset(&ResetRequest::default()).await.unwrap_err();
        let source = err.client_error().expect("a server's error");
        assert!(source.is_server_gone(), "{err}");
        let servers = fleet.servers().await.unwrap();
        assert!(
            servers.iter().all(|s| s.is_down(Instant::now())),
            "both were tried and passed over"
        );
    }
}
