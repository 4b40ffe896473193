//! Bad limit settings stop the proxy at start with an error that names the setting,
//! before it connects anywhere (no cluster needed: the settings are read first).

#![allow(clippy::panic)] // test code: a panic is the failure report

use std::process::Command;

/// Settings given, and the words the error must contain.
type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);

/// Runs the proxy binary with `env` and no Kubernetes configuration; its exit status and stderr.
fn run(env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flexinfer-proxy"));
    cmd.arg("--log-text")
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("FLEXINFER_PROXY_LISTEN_ADDR", "127.0.0.1:0")
        .env("FLEXINFER_PROXY_HEALTH_ADDR", "127.0.0.1:0");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run the proxy: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn bad_limit_settings_are_refused_by_name() {
    let cases: [Case; 6] = [
        (
            &[
                ("FLEXINFER_PROXY_MAX_BODY_BYTES", "100000000"),
                ("FLEXINFER_PROXY_BODY_MEMORY_BYTES", "1000000"),
            ],
            &[
                "FLEXINFER_PROXY_MAX_BODY_BYTES",
                "FLEXINFER_PROXY_BODY_MEMORY_BYTES",
                "100000000",
            ],
        ),
        (
            &[("FLEXINFER_PROXY_BODY_READ_TIMEOUT", "0s")],
            &["FLEXINFER_PROXY_BODY_READ_TIMEOUT"],
        ),
        (
            &[("FLEXINFER_PROXY_HEADER_READ_TIMEOUT", "soon")],
            &["FLEXINFER_PROXY_HEADER_READ_TIMEOUT", "soon"],
        ),
        (
            &[("FLEXINFER_PROXY_MAX_REQUESTS_PER_MODEL", "0")],
            &["FLEXINFER_PROXY_MAX_REQUESTS_PER_MODEL"],
        ),
        (
            &[("FLEXINFER_PROXY_MAX_CONNECTIONS", "0")],
            &["FLEXINFER_PROXY_MAX_CONNECTIONS"],
        ),
        (
            &[("FLEXINFER_PROXY_COLD_START_RELEASE", "0")],
            &["FLEXINFER_PROXY_COLD_START_RELEASE"],
        ),
    ];
    for (env, named) in cases {
        let (code, text) = run(env);
        assert_ne!(code, Some(0), "{env:?} was accepted: {text}");
        for n in named {
            assert!(
                text.contains(n),
                "{env:?}: the error does not name {n}: {text}"
            );
        }
        assert!(
            !text.contains("Kubernetes client"),
            "{env:?}: refused only when connecting, not at the setting: {text}"
        );
    }
    // Good settings pass the checks and fail only later, at the (absent) cluster.
    let (code, text) = run(&[("FLEXINFER_PROXY_MAX_REQUESTS", "10")]);
    assert_ne!(code, Some(0));
    assert!(text.contains("Kubernetes client"), "{text}");
}
