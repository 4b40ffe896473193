//! The registry API calls of [`Registry`]: blobs (exists, push), manifests (put, get), tags and the file
//! layers of an artifact.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, LOCATION};
use reqwest::StatusCode;

use flexinfer_contract::oci_artifact;
use futures::TryStreamExt;
use serde::Deserialize;

use super::artifact::{file_layers, ArtifactKind};
use super::{sha256_digest, transport, Manifest, OciError, Reference, Registry};
use crate::http;
use crate::remote::RemoteFile;
use crate::retry::Retry;

impl Registry {
    /// Does the repository already hold this blob?
    pub async fn blob_exists(&self, digest: &str) -> Result<bool, OciError> {
        let url = self.url(&format!("blobs/{digest}"));
        let resp = self.send("blob HEAD", |c| c.head(&url)).await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            s => Err(self.status_error("blob HEAD", s, "")),
        }
    }

    async fn start_upload(&self) -> Result<String, OciError> {
        let url = self.url("blobs/uploads/");
        let resp = self
            .send("starting a blob upload", |c| {
                c.post(&url).header(CONTENT_LENGTH, 0)
            })
            .await?;
        if resp.status() != StatusCode::ACCEPTED {
            let s = resp.status();
            let body = http::error_text(resp).await;
            return Err(self.status_error("starting a blob upload", s, &body));
        }
        let loc = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or(OciError::NoUploadLocation)?;
        Ok(self.absolute(loc))
    }

    fn absolute(&self, loc: &str) -> String {
        if loc.starts_with("http://") || loc.starts_with("https://") {
            loc.to_string()
        } else {
            format!("{}/{}", self.base, loc.trim_start_matches('/'))
        }
    }

    /// Upload small bytes (the config blob) unless present.
    pub async fn push_bytes(&self, bytes: &[u8]) -> Result<String, OciError> {
        let digest = sha256_digest(bytes);
        if self.blob_exists(&digest).await? {
            return Ok(digest);
        }
        let loc = self.start_upload().await?;
        let url = with_digest(&loc, &digest);
        let body = bytes.to_vec();
        let resp = self
            .send("uploading a blob", |c| {
                c.put(&url)
                    .header(CONTENT_TYPE, "application/octet-stream")
                    .body(body.clone())
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            let s = resp.status();
            let body = http::error_text(resp).await;
            return Err(self.status_error("uploading a blob", s, &body));
        }
        Ok(digest)
    }

    /// Stream a file as one monolithic PUT (`Content-Length` known, never whole in memory).
    /// `sent` counts bytes handed to the connection.
    pub async fn push_file(
        &self,
        path: &Path,
        digest: &str,
        size: u64,
        sent: Arc<AtomicU64>,
    ) -> Result<(), OciError> {
        let mut retry = Retry::new(Duration::from_secs(1), Duration::from_secs(10), 4);
        loop {
            let before = sent.load(Ordering::Relaxed);
            match self.push_file_once(path, digest, size, &sent).await {
                Ok(()) => return Ok(()),
                Err(m) if !m.is_bad_input() => {
                    // Bytes of the failed attempt do not count.
                    let now = sent.load(Ordering::Relaxed);
                    sent.fetch_sub(now.saturating_sub(before), Ordering::Relaxed);
                    let Some(delay) = retry.next_delay() else {
                        return Err(m);
                    };
                    let attempt = retry.attempt();
                    let why = flexinfer_contract::error::chain(&m);
                    tracing::warn!(error = %why, attempt, "blob upload failed; retrying");
                    eprintln!(
                        "retrying upload of {} in {delay:.1?} (attempt {attempt}): {why}",
                        path.display()
                    );
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn push_file_once(
        &self,
        path: &Path,
        digest: &str,
        size: u64,
        sent: &Arc<AtomicU64>,
    ) -> Result<(), OciError> {
        let loc = self.start_upload().await?;
        let url = with_digest(&loc, digest);
        let file = tokio::fs::File::open(path)
            .await
            .map_err(|source| OciError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        let counter = sent.clone();
        let stream =
            tokio_util::io::ReaderStream::with_capacity(file, 1 << 20).inspect_ok(move |b| {
                counter.fetch_add(b.len() as u64, Ordering::Relaxed);
            });
        let mut req = self
            .client
            .put(&url)
            .header(CONTENT_TYPE, "application/octet-stream")
            .header(CONTENT_LENGTH, size)
            .body(reqwest::Body::wrap_stream(stream));
        // An upload Location on another host (a storage backend) gets no registry credentials.
        let target = reqwest::Url::parse(&url)
            .map_err(|_| OciError::UploadLocationNotAUrl { url: url.clone() })?;
        if let Some(h) = self.auth_for(&target).await {
            req = req.header(AUTHORIZATION, h);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| transport("uploading a blob", e))?;
        if resp.status() == StatusCode::CREATED {
            return Ok(());
        }
        let s = resp.status();
        let body = http::error_text(resp).await;
        if s == StatusCode::UNAUTHORIZED {
            // Token expired mid-upload: renegotiate and let the caller retry.
            *self.auth.lock().await = None;
            return Err(OciError::TokenExpired {
                path: path.to_path_buf(),
            });
        }
        Err(self.status_error(&format!("uploading {}", path.display()), s, &body))
    }

    /// PUT a manifest under a tag (or digest); returns the digest the registry reports.
    pub async fn put_manifest(&self, reference: &str, body: &[u8]) -> Result<String, OciError> {
        let url = self.url(&format!("manifests/{reference}"));
        let body = body.to_vec();
        let resp = self
            .send("pushing the manifest", |c| {
                c.put(&url)
                    .header(CONTENT_TYPE, oci_artifact::MANIFEST_MEDIA_TYPE)
                    .body(body.clone())
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            let s = resp.status();
            let text = http::error_text(resp).await;
            return Err(self.status_error(&format!("pushing manifest {reference}"), s, &text));
        }
        Ok(resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .unwrap_or_else(|| sha256_digest(&body)))
    }

    /// GET a manifest by tag or digest; returns (digest of the bytes, bytes).
    pub async fn get_manifest(&self, reference: &str) -> Result<(String, Vec<u8>), OciError> {
        let url = self.url(&format!("manifests/{reference}"));
        let resp = self
            .send("fetching the manifest", |c| {
                c.get(&url).header(
                    reqwest::header::ACCEPT,
                    format!(
                        "{}, application/vnd.docker.distribution.manifest.v2+json",
                        oci_artifact::MANIFEST_MEDIA_TYPE
                    ),
                )
            })
            .await?;
        if !resp.status().is_success() {
            let s = resp.status();
            let text = http::error_text(resp).await;
            return Err(self.status_error(
                &format!("manifest {}:{reference}", self.repository),
                s,
                &text,
            ));
        }
        let what = format!("manifest {}:{reference}", self.repository);
        let bytes = http::read_body_limited(resp, http::limits::OCI_MANIFEST, &what)
            .await
            .map_err(OciError::Body)?;
        Ok((sha256_digest(&bytes), bytes))
    }

    /// All tags of the repository.
    pub async fn list_tags(&self) -> Result<Vec<String>, OciError> {
        #[derive(Deserialize)]
        struct Tags {
            #[serde(default)]
            tags: Option<Vec<String>>,
        }
        let mut url = self.url("tags/list?n=1000");
        let mut out = Vec::new();
        for _ in 0..1000 {
            let resp = self.send("listing tags", |c| c.get(&url)).await?;
            if resp.status() == StatusCode::NOT_FOUND {
                return Ok(out);
            }
            if !resp.status().is_success() {
                let s = resp.status();
                return Err(self.status_error("listing tags", s, ""));
            }
            let next = http::next_link(resp.headers()).map(|u| self.absolute(&u));
            let body = http::read_body_limited(resp, http::limits::TAG_LIST, "listing tags")
                .await
                .map_err(OciError::Body)?;
            let t: Tags = serde_json::from_slice(&body).map_err(OciError::TagListNotJson)?;
            out.extend(t.tags.unwrap_or_default());
            match next {
                Some(n) => url = n,
                None => break,
            }
        }
        Ok(out)
    }

    /// The files of a model artifact (ModelPack, plain ORAS, or FlexInfer's earlier layout; see
    /// [`super::artifact`]): (manifest digest, one entry per file layer).
    pub async fn artifact_files(
        &self,
        reference: &Reference,
    ) -> Result<(String, Vec<RemoteFile>), OciError> {
        let what = reference
            .digest
            .clone()
            .or(reference.tag.clone())
            .unwrap_or_else(|| "latest".into());
        let (digest, bytes) = self.get_manifest(&what).await?;
        if let Some(want) = &reference.digest {
            if *want != digest {
                return Err(OciError::DigestMismatch {
                    want: want.clone(),
                    served: digest,
                });
            }
        }
        let m: Manifest =
            serde_json::from_slice(&bytes).map_err(|source| OciError::NotAManifest {
                reference: reference.to_string(),
                source,
            })?;
        let layers = file_layers(&reference.to_string(), &m)?;
        tracing::info!(
            kind = ArtifactKind::of(&m).describe(),
            layers = layers.len(),
            "reading the artifact's file layers"
        );
        let files = layers
            .into_iter()
            .map(|l| RemoteFile {
                url: self.url(&format!("blobs/{}", l.digest)),
                sha256: l.digest.strip_prefix("sha256:").map(String::from),
                path: l.path,
                size: l.size,
                git_sha1: None,
            })
            .collect();
        Ok((digest, files))
    }
}

fn with_digest(location: &str, digest: &str) -> String {
    let sep = if location.contains('?') { '&' } else { '?' };
    format!("{location}{sep}digest={}", digest.replace(':', "%3A"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upload_urls() {
        assert_eq!(
            with_digest("http://h/u/1?_state=x", "sha256:ab"),
            "http://h/u/1?_state=x&digest=sha256%3Aab"
        );
        assert_eq!(
            with_digest("http://h/u/1", "sha256:ab"),
            "http://h/u/1?digest=sha256%3Aab"
        );
    }
}
