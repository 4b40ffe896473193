//! A real OCI registry for the tests: Debian's `docker-registry` (distribution 2.8) started on a
//! free loopback port with a temporary storage dir; its request log lets tests count uploads.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

pub struct Registry {
    pub addr: String,
    pub log: PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Registry {
    pub fn start() -> Registry {
        Registry::start_inner(None)
    }

    /// A registry that requires HTTP Basic auth (htpasswd, bcrypt) for `user`/`password`.
    pub fn start_with_auth(user: &str, password: &str) -> Registry {
        Registry::start_inner(Some((user, password)))
    }

    fn start_inner(auth: Option<(&str, &str)>) -> Registry {
        assert!(
            Path::new(REGISTRY_BIN).is_file(),
            "{REGISTRY_BIN} is missing: these tests need a real OCI registry. Install Debian's \
             docker-registry package (apt-get install -y docker-registry; .ci/run does this) — \
             the system service does not need to run."
        );
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                dir.path().join("storage").display()
            ),
        )
        .unwrap();
        if let Some((user, password)) = auth {
            let hash = bcrypt::hash_with_result(password, 4)
                .unwrap()
                .format_for_version(bcrypt::Version::TwoA);
            let htpasswd = dir.path().join("htpasswd");
            std::fs::write(&htpasswd, format!("{user}:{hash}\n")).unwrap();
            let mut text = std::fs::read_to_string(&config).unwrap();
            text.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: test-realm\n    path: {}\n",
                htpasswd.display()
            ));
            std::fs::write(&config, text).unwrap();
        }
        let log = dir.path().join("registry.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("start docker-registry");
        let mut reg = Registry {
            addr,
            log,
            child,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(&reg.addr) {
                use std::io::Write;
                let _ = write!(s, "GET /v2/ HTTP/1.0\r\n\r\n");
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                let code = buf.split_whitespace().nth(1).unwrap_or("");
                if code == "200" || (auth.is_some() && code == "401") {
                    break;
                }
            }
            if let Ok(Some(st)) = reg.child.try_wait() {
                panic!("docker-registry exited ({st}): {}", reg.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "docker-registry did not come up: {}",
                reg.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        reg
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Completed monolithic blob uploads (access-log lines `"PUT …/blobs/uploads/…digest=… " 201`),
    /// as the digests uploaded, in order.
    pub fn uploaded_digests(&self) -> Vec<String> {
        self.log_text()
            .lines()
            .filter(|l| {
                l.contains("\"PUT /v2/") && l.contains("/blobs/uploads/") && l.contains("\" 201 ")
            })
            .filter_map(|l| {
                let i = l.find("digest=")? + "digest=".len();
                let d: String = l[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '%' || *c == ':')
                    .collect();
                Some(d.replace("%3A", ":").replace("%3a", ":"))
            })
            .collect()
    }

    /// GET a registry API path; (status, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(&self.addr).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.0\r\nHost: {}\r\nAccept: application/vnd.oci.image.manifest.v1+json\r\n\r\n",
            self.addr
        )
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        let status = buf
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = buf
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    }

    /// One HTTP/1.1 request (`Connection: close`); (status, headers as lowercase name → value, body).
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, Vec<(String, String)>, Vec<u8>) {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(&self.addr).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).unwrap();
        let split = buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("an HTTP answer");
        let text = String::from_utf8_lossy(&buf[..split]).to_string();
        let mut lines = text.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let hs = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        (status, hs, buf[split + 4..].to_vec())
    }

    /// Uploads `bytes` as a blob of `repo` (POST, then a monolithic PUT); returns its digest.
    pub fn put_blob(&self, repo: &str, bytes: &[u8]) -> String {
        use sha2::Digest;
        let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)));
        let (st, hs, _) = self.request("POST", &format!("/v2/{repo}/blobs/uploads/"), &[], b"");
        assert_eq!(st, 202, "starting an upload to {repo}");
        let loc = hs
            .iter()
            .find(|(k, _)| k == "location")
            .map(|(_, v)| v.clone())
            .expect("upload Location");
        let path = loc
            .split_once("://")
            .map(|(_, rest)| rest[rest.find('/').unwrap_or(rest.len())..].to_string())
            .unwrap_or(loc);
        let sep = if path.contains('?') { '&' } else { '?' };
        let (st, _, body) = self.request(
            "PUT",
            &format!("{path}{sep}digest={}", digest.replace(':', "%3A")),
            &[("Content-Type", "application/octet-stream")],
            bytes,
        );
        assert_eq!(st, 201, "{}", String::from_utf8_lossy(&body));
        digest
    }

    /// Puts `manifest` (an OCI image manifest) under `tag`; returns the digest of its bytes.
    pub fn put_manifest(&self, repo: &str, tag: &str, manifest: &serde_json::Value) -> String {
        use sha2::Digest;
        let body = serde_json::to_vec(manifest).unwrap();
        let (st, _, answer) = self.request(
            "PUT",
            &format!("/v2/{repo}/manifests/{tag}"),
            &[("Content-Type", "application/vnd.oci.image.manifest.v1+json")],
            &body,
        );
        assert_eq!(st, 201, "{}", String::from_utf8_lossy(&answer));
        format!("sha256:{}", hex::encode(sha2::Sha256::digest(&body)))
    }

    /// GET a blob's bytes.
    pub fn blob(&self, repo: &str, digest: &str) -> Vec<u8> {
        let (st, _, body) = self.request("GET", &format!("/v2/{repo}/blobs/{digest}"), &[], b"");
        assert_eq!(st, 200, "blob {digest} of {repo}");
        body
    }

    pub fn tags(&self, repo: &str) -> Vec<String> {
        let (st, body) = self.get(&format!("/v2/{repo}/tags/list"));
        assert_eq!(st, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let mut t: Vec<String> = v["tags"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        t.sort();
        t
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
