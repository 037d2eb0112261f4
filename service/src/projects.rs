//! Projects and their tokens, kept in the store (`projects/<name>.json`,
//! `tokens/<hash>.json`) so every node sharing the store sees the same ones. A token is
//! shown once, when it is made; the store holds only its BLAKE3 hash, and a token's ID (the
//! hash's first 12 hex digits) is what audits and `token revoke` name.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use strata_catalog::Backend;
use strata_store::Store;

use crate::error::ServiceError;

/// How long a token check is remembered; a revocation takes effect within it.
pub const AUTH_CACHE: Duration = Duration::from_secs(2);

/// What a project may do and use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Project {
    pub name: String,
    /// Live sandboxes at once; `None`: no limit.
    #[serde(default)]
    pub max_sandboxes: Option<u32>,
    /// Memory budgets of its live sandboxes together, bytes.
    #[serde(default)]
    pub max_memory: Option<u64>,
    /// CPU budgets of its live sandboxes together.
    #[serde(default)]
    pub max_cpus: Option<f64>,
    /// Bytes its store snapshots may hold together (what their restores fetch); a
    /// snapshot is refused once they hold this much.
    #[serde(default)]
    pub max_snapshot_storage: Option<u64>,
    /// Catalog namespaces it registers and removes in (it resolves every entry).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Backends its sandboxes may use; empty: every one.
    #[serde(default)]
    pub backends: Vec<Backend>,
    /// Its sandboxes may ask for open internet (the E2B API's `allow_internet_access`);
    /// otherwise only named destinations are reachable.
    #[serde(default)]
    pub allow_internet: bool,
    pub created_ms: u64,
}

impl Project {
    pub fn allows_backend(&self, b: Backend) -> bool {
        self.backends.is_empty() || self.backends.contains(&b)
    }

    pub fn owns_namespace(&self, namespace: &str) -> bool {
        self.namespaces.iter().any(|n| n == namespace)
    }
}

/// A token as the store keeps it: never the token itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// The first 12 hex digits of the token's hash.
    pub id: String,
    pub project: String,
    pub created_ms: u64,
    #[serde(default)]
    pub revoked_ms: Option<u64>,
}

/// Who is calling: a live token of a project.
#[derive(Debug, Clone)]
pub struct Caller {
    pub project: Project,
    pub token: String,
}

impl Caller {
    /// How the audit names the caller.
    pub fn identity(&self) -> String {
        format!("project:{} token:{}", self.project.name, self.token)
    }
}

/// Whether a sandbox's recorded identity is a service caller's ([`Caller::identity`]), as
/// opposed to a local CLI user's: the node service answers only for those.
pub fn is_service_identity(identity: &str) -> bool {
    identity
        .strip_prefix("project:")
        .is_some_and(|rest| rest.contains(" token:"))
}

const TOKEN_PREFIX: &str = "strata_";

fn token_hash(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A project name is a catalog-namespace-like word: it appears in paths and IDs.
pub fn check_name(name: &str) -> Result<(), ServiceError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "project",
            format!("`{name}` is not a project name: use 1-63 of a-z, 0-9, - and _"),
        ))
    }
}

/// The JSON object at `key` of `backend`; `None` when there is none. One that does not
/// parse is corrupt, never taken for absent.
pub(crate) async fn read_json<T: for<'de> Deserialize<'de>>(
    backend: &dyn ObjectStore,
    key: &ObjectPath,
) -> Result<Option<T>, ServiceError> {
    match backend.get(key).await {
        Ok(r) => {
            let bytes = r.bytes().await.map_err(|source| ServiceError::Backend {
                key: key.to_string(),
                source,
            })?;
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| ServiceError::Corrupt {
                    key: key.to_string(),
                    reason: e.to_string(),
                })
        }
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(source) => Err(ServiceError::Backend {
            key: key.to_string(),
            source,
        }),
    }
}

/// The keys of every object under `prefix` of `backend`.
pub(crate) async fn list_keys(
    backend: &dyn ObjectStore,
    prefix: &ObjectPath,
) -> Result<Vec<ObjectPath>, ServiceError> {
    use futures::TryStreamExt;
    let metas: Vec<_> = backend
        .list(Some(prefix))
        .try_collect()
        .await
        .map_err(|source| ServiceError::Backend {
            key: prefix.to_string(),
            source,
        })?;
    Ok(metas.into_iter().map(|m| m.location).collect())
}

/// Writes `value` as JSON at `key` of `backend`; with `create`, only if nothing is there
/// yet (`false`: something was, and is left as it is).
pub(crate) async fn write_json<T: Serialize>(
    backend: &dyn ObjectStore,
    key: &ObjectPath,
    value: &T,
    create: bool,
) -> Result<bool, ServiceError> {
    let body =
        serde_json::to_vec_pretty(value).map_err(|e| ServiceError::Internal(e.to_string()))?;
    let opts = PutOptions {
        mode: if create {
            PutMode::Create
        } else {
            PutMode::Overwrite
        },
        ..Default::default()
    };
    match backend.put_opts(key, PutPayload::from(body), opts).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::AlreadyExists { .. }) if create => Ok(false),
        Err(source) => Err(ServiceError::Backend {
            key: key.to_string(),
            source,
        }),
    }
}

/// The projects and tokens of a store.
#[derive(Clone)]
pub struct Projects {
    backend: Arc<dyn ObjectStore>,
    checked: Arc<Mutex<HashMap<String, (Instant, Caller)>>>,
}

impl Projects {
    pub fn new(store: &Store) -> Projects {
        Projects {
            backend: store.backend().clone(),
            checked: Arc::default(),
        }
    }

    fn project_key(name: &str) -> ObjectPath {
        ObjectPath::from(format!("projects/{name}.json"))
    }

    fn token_key(hash: &str) -> ObjectPath {
        ObjectPath::from(format!("tokens/{hash}.json"))
    }

    async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        key: &ObjectPath,
    ) -> Result<Option<T>, ServiceError> {
        read_json(self.backend.as_ref(), key).await
    }

    async fn put_json<T: Serialize>(
        &self,
        key: &ObjectPath,
        value: &T,
        create: bool,
    ) -> Result<(), ServiceError> {
        if write_json(self.backend.as_ref(), key, value, create).await? {
            Ok(())
        } else {
            Err(ServiceError::AlreadyExists(format!("{key} already exists")))
        }
    }

    /// Adds a project; one of the same name is refused.
    pub async fn create(&self, project: &Project) -> Result<(), ServiceError> {
        check_name(&project.name)?;
        self.put_json(&Self::project_key(&project.name), project, true)
            .await
            .map_err(|e| match e {
                ServiceError::AlreadyExists(_) => ServiceError::AlreadyExists(format!(
                    "project `{}` already exists (see `strata project ls`)",
                    project.name
                )),
                e => e,
            })
    }

    pub async fn get(&self, name: &str) -> Result<Project, ServiceError> {
        check_name(name)?;
        self.get_json(&Self::project_key(name)).await?.ok_or_else(|| {
            ServiceError::NotFound(format!(
                "no project `{name}` (see `strata project ls`, or make it with `strata project create {name}`)"
            ))
        })
    }

    /// The keys of the objects under `prefix`.
    async fn keys(&self, prefix: &str) -> Result<Vec<ObjectPath>, ServiceError> {
        list_keys(self.backend.as_ref(), &ObjectPath::from(prefix)).await
    }

    async fn list_prefix<T: for<'de> Deserialize<'de>>(
        &self,
        prefix: &str,
    ) -> Result<Vec<T>, ServiceError> {
        let mut out = Vec::new();
        for key in self.keys(prefix).await? {
            if let Some(v) = self.get_json(&key).await? {
                out.push(v);
            }
        }
        Ok(out)
    }

    pub async fn list(&self) -> Result<Vec<Project>, ServiceError> {
        let mut all: Vec<Project> = self.list_prefix("projects").await?;
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    /// Makes a token for `project`; the token is returned once and never stored.
    pub async fn create_token(&self, project: &str) -> Result<(String, TokenRecord), ServiceError> {
        self.get(project).await?;
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret)
            .map_err(|e| ServiceError::Internal(format!("no randomness for a token: {e}")))?;
        let token = format!("{TOKEN_PREFIX}{}", hex::encode(secret));
        let hash = token_hash(&token);
        let record = TokenRecord {
            id: hash[..12].to_string(),
            project: project.to_string(),
            created_ms: now_ms(),
            revoked_ms: None,
        };
        self.put_json(&Self::token_key(&hash), &record, true)
            .await?;
        Ok((token, record))
    }

    /// Every token of `project` (all projects' when `None`), revoked ones included.
    pub async fn tokens(&self, project: Option<&str>) -> Result<Vec<TokenRecord>, ServiceError> {
        let mut all: Vec<TokenRecord> = self.list_prefix("tokens").await?;
        all.retain(|t| project.is_none_or(|p| t.project == p));
        all.sort_by_key(|t| t.created_ms);
        Ok(all)
    }

    /// Revokes a token, named by the token itself or by its ID.
    pub async fn revoke(&self, token_or_id: &str) -> Result<TokenRecord, ServiceError> {
        let key = if token_or_id.starts_with(TOKEN_PREFIX) {
            Self::token_key(&token_hash(token_or_id))
        } else {
            let id = token_or_id.to_ascii_lowercase();
            if id.len() < 6 || !id.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(ServiceError::invalid(
                    "token",
                    format!(
                        "`{token_or_id}` is neither a token nor a token ID (see `strata token ls`)"
                    ),
                ));
            }
            let hits: Vec<ObjectPath> = self
                .keys("tokens")
                .await?
                .into_iter()
                .filter(|k| k.filename().is_some_and(|f| f.starts_with(&id)))
                .collect();
            match hits.as_slice() {
                [one] => one.clone(),
                [] => {
                    return Err(ServiceError::NotFound(format!(
                        "no token with ID {token_or_id} (see `strata token ls`)"
                    )))
                }
                _ => {
                    return Err(ServiceError::invalid(
                        "token",
                        format!("token ID {token_or_id} is ambiguous; give more digits"),
                    ))
                }
            }
        };
        let mut record: TokenRecord = self.get_json(&key).await?.ok_or_else(|| {
            ServiceError::NotFound("no such token (see `strata token ls`)".to_string())
        })?;
        if record.revoked_ms.is_none() {
            record.revoked_ms = Some(now_ms());
            self.put_json(&key, &record, false).await?;
        }
        self.checked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        Ok(record)
    }

    /// The caller a presented token stands for; refused if unknown, revoked or of a
    /// removed project.
    pub async fn authenticate(&self, token: &str) -> Result<Caller, ServiceError> {
        let hash = token_hash(token);
        if let Some((at, caller)) = self
            .checked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&hash)
        {
            if at.elapsed() < AUTH_CACHE {
                return Ok(caller.clone());
            }
        }
        let refused = || {
            ServiceError::Unauthenticated(
                "the token is not valid (revoked or never issued); make one with `strata token create --project NAME`".into(),
            )
        };
        if !token.starts_with(TOKEN_PREFIX) {
            return Err(refused());
        }
        let record: TokenRecord = self
            .get_json(&Self::token_key(&hash))
            .await?
            .ok_or_else(refused)?;
        if record.revoked_ms.is_some() {
            return Err(refused());
        }
        let project = self.get(&record.project).await.map_err(|e| match e {
            ServiceError::NotFound(_) => refused(),
            e => e,
        })?;
        let caller = Caller {
            project,
            token: record.id,
        };
        let mut checked = self.checked.lock().unwrap_or_else(|p| p.into_inner());
        if checked.len() > 10_000 {
            checked.clear();
        }
        checked.insert(hash, (Instant::now(), caller.clone()));
        Ok(caller)
    }
}
