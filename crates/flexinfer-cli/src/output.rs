//! Output formats: aligned tables for people, JSON/YAML for scripts.

use clap::ValueEnum;
use serde::Serialize;

/// `-o/--output`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    // No doc comments on the variants: clap then lists them inline in `--help`.
    #[default]
    Table,
    Json,
    Yaml,
}

/// Serialize for `-o json|yaml`.
pub fn structured<T: Serialize>(fmt: Format, v: &T) -> anyhow::Result<String> {
    Ok(match fmt {
        Format::Json => format!("{}\n", serde_json::to_string_pretty(v)?),
        Format::Yaml => serde_norway::to_string(v)?,
        Format::Table => String::new(),
    })
}

/// An aligned table with a header row; columns are separated by three spaces like kubectl.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let n = cells.len();
        let mut s = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 == n {
                s.push_str(c);
            } else {
                s.push_str(c);
                s.push_str(&" ".repeat(widths[i] - c.chars().count() + 3));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// Key/value report lines (`Key:  value`), aligned.
pub fn kv(rows: &[(&str, String)]) -> String {
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    rows.iter()
        .map(|(k, v)| format!("{:<w$} {}\n", format!("{k}:"), v, w = w))
        .collect()
}

/// Human byte size (GiB/MiB).
pub fn bytes(n: i64) -> String {
    let f = n as f64;
    if f >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", f / (1024.0 * 1024.0 * 1024.0))
    } else if f >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", f / (1024.0 * 1024.0))
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns() {
        let t = table(
            &["NAME", "PHASE"],
            &[
                vec!["a".into(), "Ready".into()],
                vec!["longer".into(), "-".into()],
            ],
        );
        assert_eq!(t, "NAME     PHASE\na        Ready\nlonger   -\n");
    }

    #[test]
    fn sizes() {
        assert_eq!(bytes(5), "5 B");
        assert_eq!(bytes(3 * 1024 * 1024), "3.0 MiB");
        assert_eq!(bytes(16 * 1024 * 1024 * 1024), "16.00 GiB");
    }
}
