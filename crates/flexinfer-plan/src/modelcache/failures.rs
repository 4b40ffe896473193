//! Failure classification and the failure text that goes into status and events (redacted).

use flexinfer_api::contract::{FailureReason, TerminationMessage};

use super::observe::{JobState, ObservedJob};
use super::types::LogTail;

/// Remove secrets from text that goes into status, events or logs: Hugging Face tokens,
/// bearer tokens, and `key=value` / `key: value` pairs whose key names a credential.
pub fn redact(s: &str) -> String {
    const KEYS: [&str; 6] = [
        "token",
        "password",
        "passwd",
        "secret",
        "authorization",
        "apikey",
    ];
    let mut out = String::with_capacity(s.len());
    let mut redact_next = false;
    for (i, part) in s.split_inclusive(char::is_whitespace).enumerate() {
        let word = part.trim_end();
        let ws = &part[word.len()..];
        let _ = i;
        let lower = word.to_ascii_lowercase();
        let w = if lower == "bearer" || lower == "basic" {
            redact_next = true;
            word.to_string()
        } else if redact_next && !word.is_empty() {
            redact_next = false;
            "[REDACTED]".to_string()
        } else if word.starts_with("hf_") && word.len() > 10 {
            "[REDACTED]".to_string()
        } else if let Some(pos) = word.find(['=', ':']) {
            let key = lower[..pos].trim_matches(|c: char| !c.is_ascii_alphanumeric());
            let key_flat: String = key.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
            if KEYS.iter().any(|k| key_flat.ends_with(k)) {
                if word.get(pos.saturating_add(1)..).is_none_or(str::is_empty) {
                    redact_next = true;
                    word.to_string()
                } else {
                    format!("{}[REDACTED]", &word[..=pos])
                }
            } else {
                word.to_string()
            }
        } else {
            word.to_string()
        };
        out.push_str(&w);
        out.push_str(ws);
    }
    out
}

pub(super) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    format!(
        "…{}",
        flexinfer_api::contract::termination::tail_chars(s, max)
    )
}

fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Classify a failed (or stuck) Job: `OOMKilled`, `DeadlineExceeded`, `ImagePullBackOff`,
/// `BackoffLimitExceeded`, `BadInput`/`QualityGateFailed`/`ScriptVersionMismatch` (worker exit
/// codes 2/3/4), else `JobFailed`.
pub fn classify_failure(j: &ObservedJob) -> FailureReason {
    let pod = j.pod.as_ref();
    if pod.and_then(|p| p.terminated_reason.as_deref()) == Some(FailureReason::OomKilled.as_str()) {
        return FailureReason::OomKilled;
    }
    let job_reason = match &j.state {
        JobState::Failed { reason, .. } => reason.as_str(),
        _ => "",
    };
    if job_reason == FailureReason::DeadlineExceeded.as_str() {
        return FailureReason::DeadlineExceeded;
    }
    if pod
        .and_then(|p| p.waiting_reason.as_deref())
        .is_some_and(is_image_pull_failure)
    {
        return FailureReason::ImagePullBackOff;
    }
    if pod.is_some_and(|p| p.unschedulable.is_some()) {
        return FailureReason::Unschedulable;
    }
    if job_reason == FailureReason::BackoffLimitExceeded.as_str() {
        return FailureReason::BackoffLimitExceeded;
    }
    // Deterministic worker exits end the Job at once through its podFailurePolicy.
    pod.and_then(|p| p.exit_code)
        .and_then(FailureReason::from_exit_code)
        .unwrap_or(FailureReason::JobFailed)
}

/// Pull failures that a retry by the kubelet can still cure (registry down, credentials being
/// fixed): they count as a failure only after the stuck-pod threshold.
pub(super) fn is_transient_pull_failure(reason: &str) -> bool {
    matches!(reason, "ImagePullBackOff" | "ErrImagePull")
}

pub(super) fn is_image_pull_failure(reason: &str) -> bool {
    matches!(
        reason,
        "ImagePullBackOff" | "ErrImagePull" | "InvalidImageName" | "ErrImageNeverPull"
    )
}

/// Human failure text: termination message, else the log tail, else the Job condition message.
pub(super) fn failure_text(j: &ObservedJob, log_tail: Option<&LogTail>) -> String {
    let pod = j.pod.as_ref();
    let from_term =
        pod.and_then(|p| p.termination_message.as_deref()).map(
            |m| match TerminationMessage::parse(m) {
                Some(TerminationMessage::Failure(f)) => {
                    let tail = last_lines(&f.tail, 5);
                    if tail.is_empty() {
                        format!("exit {}: {}", f.exit_code, f.error)
                    } else {
                        format!("exit {}: {}\n{}", f.exit_code, f.error, tail)
                    }
                }
                _ => last_lines(m, 10),
            },
        );
    let text = from_term
        .or_else(|| match log_tail {
            Some(LogTail::Read(t)) if !t.trim().is_empty() => Some(last_lines(t, 10)),
            _ => None,
        })
        .or_else(|| pod.and_then(|p| p.waiting_message.clone()))
        .or_else(|| pod.and_then(|p| p.unschedulable.clone()))
        .or_else(|| match &j.state {
            JobState::Failed { message, .. } if !message.is_empty() => Some(message.clone()),
            _ => None,
        })
        .unwrap_or_else(|| "no termination message or log available".into());
    truncate(&redact(&text), 1024)
}
