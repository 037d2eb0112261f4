//! Where a store lives: parsing `--store` URLs. Which store to use when none is given is
//! the caller's decision (the `strata` binary's settings), not this crate's.

use std::path::PathBuf;

use crate::StoreError;

/// A parsed store address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A directory on this machine.
    Local(PathBuf),
    /// An S3-compatible bucket. Credentials come from the standard `AWS_*` environment
    /// variables, which `object_store` reads itself; the region from the URL, else
    /// [`crate::StoreOptions::region`].
    S3 {
        bucket: String,
        endpoint: Option<String>,
        region: Option<String>,
        prefix: String,
    },
}

impl StoreUrl {
    /// Parses `/path`, `file:///path`, or `s3://bucket[/prefix][?endpoint=URL&region=R]`.
    pub fn parse(input: &str) -> Result<StoreUrl, StoreError> {
        let bad = |reason: &str| StoreError::Url {
            url: input.to_string(),
            reason: reason.to_string(),
        };
        if input.starts_with('/') {
            return Ok(StoreUrl::Local(PathBuf::from(input)));
        }
        let url = url::Url::parse(input).map_err(|e| {
            bad(&format!(
                "{e}; use an absolute directory path, file:///dir or s3://bucket?endpoint=http://host:port"
            ))
        })?;
        match url.scheme() {
            "file" => Ok(StoreUrl::Local(PathBuf::from(url.path()))),
            "s3" => {
                let bucket = url
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| bad("the bucket name is missing (s3://BUCKET)"))?
                    .to_string();
                let mut endpoint = None;
                let mut region = None;
                for (k, v) in url.query_pairs() {
                    match k.as_ref() {
                        "endpoint" => endpoint = Some(v.into_owned()),
                        "region" => region = Some(v.into_owned()),
                        other => {
                            return Err(bad(&format!(
                                "unknown parameter `{other}` (known: endpoint, region)"
                            )))
                        }
                    }
                }
                Ok(StoreUrl::S3 {
                    bucket,
                    endpoint,
                    region,
                    prefix: url.path().trim_matches('/').to_string(),
                })
            }
            other => Err(bad(&format!(
                "scheme `{other}` is not supported (use a directory path, file:// or s3://)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forms() {
        assert_eq!(
            StoreUrl::parse("/tmp/x").unwrap(),
            StoreUrl::Local("/tmp/x".into())
        );
        assert_eq!(
            StoreUrl::parse("file:///tmp/y").unwrap(),
            StoreUrl::Local("/tmp/y".into())
        );
        assert_eq!(
            StoreUrl::parse("s3://bkt/pre?endpoint=http://127.0.0.1:7480").unwrap(),
            StoreUrl::S3 {
                bucket: "bkt".into(),
                endpoint: Some("http://127.0.0.1:7480".into()),
                region: None,
                prefix: "pre".into()
            }
        );
        let err = StoreUrl::parse("s3://bkt?endpont=x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("endpont"), "{err}");
        assert!(StoreUrl::parse("ftp://x").is_err());
        assert!(StoreUrl::parse("relative/dir").is_err());
    }
}
