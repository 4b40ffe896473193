//! The controller binary refuses a setting it cannot parse at start-up, before it touches the
//! cluster, with a message naming the variable: a typo in the
//! chart's `extraEnv` is a crash-looping pod with a clear log line, not a silently ignored value.

use std::process::Command;

#[test]
fn a_bad_setting_stops_the_controller_naming_the_variable() {
    let cases = [
        ("FLEXINFER_RETRY_BASE_SECONDS", "30s"),
        ("FLEXINFER_PROGRESS_POLL_SECONDS", "1e300"),
        ("FLEXINFER_CANARY_MAX_IDLE_SECONDS", "0"),
        ("FLEXINFER_PREEMPTION_GRACE_SECONDS", "soon"),
        ("FLEXINFER_GPU_SUPPLEMENTAL_GROUPS", "render,video"),
        ("FLEXINFER_LEADER_ELECT", "ture"),
        ("FLEXINFER_WATCH_NAMESPACE", "Not_A_Namespace"),
    ];
    for (name, value) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_flexinfer-controller"))
            .arg("--log-text")
            .env(name, value)
            // No cluster: if the settings were read after connecting, the error would be about
            // the missing kubeconfig instead.
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .unwrap_or_else(|e| panic!("run the controller: {e}"));
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "{name}={value}: {log}");
        assert!(
            log.contains(name),
            "{name}={value}: the error does not name it: {log}"
        );
        assert!(
            !log.to_lowercase().contains("kubeconfig"),
            "{name}={value}: {log}"
        );
    }
}
