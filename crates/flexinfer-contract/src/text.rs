//! Cutting messages to a size at a character boundary (termination messages, device reports).

/// The first at most `max_bytes` bytes of `s`, cut at a character boundary, with `...` in place of the rest
/// when something was cut (a reason whose start says the most).
pub fn head_chars(s: &str, max_bytes: usize) -> String {
    if s.len() <= max_bytes {
        return s.to_string();
    }
    let mut end = max_bytes.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end = end.saturating_sub(1);
    }
    format!("{}...", s.get(..end).unwrap_or_default())
}

/// The last at most `max_bytes` bytes of `s`, cut at a character boundary (the end of a message is
/// where its reason is).
pub fn tail_chars(s: &str, max_bytes: usize) -> String {
    if s.len() <= max_bytes {
        return s.to_string();
    }
    let mut start = s.len().saturating_sub(max_bytes);
    while !s.is_char_boundary(start) {
        start = start.saturating_add(1);
    }
    s.get(start..).unwrap_or_default().to_string()
}
