//! `flexinfer quantize validate`: the deterministic quality gate: per format, the
//! largest perplexity increase and the smallest task-accuracy retention a quantized model may show. Pure code; the command only formats the verdict.

use serde::Serialize;

/// Tolerance for comparing against a threshold, so that an observed value exactly on the
/// threshold (e.g. 9.50 → 10.45 for +10%) passes despite binary floating point.
const EPS: f64 = 1e-9;

/// One row of the policy table.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Policy {
    pub format: &'static str,
    /// Maximum perplexity regression in percent of the baseline.
    pub max_perplexity_regression_percent: f64,
    /// Maximum acceptance-rate drop in percentage points.
    pub max_acceptance_drop_pp: f64,
}

/// The policy per format: maximum perplexity increase (%) and minimum accuracy retention (%).
pub const POLICIES: &[Policy] = &[
    Policy {
        format: "GGUF",
        max_perplexity_regression_percent: 10.0,
        max_acceptance_drop_pp: 3.0,
    },
    Policy {
        format: "AWQ",
        max_perplexity_regression_percent: 7.0,
        max_acceptance_drop_pp: 2.0,
    },
    Policy {
        format: "GPTQ",
        max_perplexity_regression_percent: 8.0,
        max_acceptance_drop_pp: 2.5,
    },
    Policy {
        format: "EXL2",
        max_perplexity_regression_percent: 6.0,
        max_acceptance_drop_pp: 2.0,
    },
    Policy {
        format: "FP8",
        max_perplexity_regression_percent: 5.0,
        max_acceptance_drop_pp: 1.5,
    },
];

/// Bad input (exit code 2).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InputError {
    #[error("--format {0}: no quality policy for this format (known: GGUF, AWQ, GPTQ, EXL2, FP8)")]
    UnknownFormat(String),
    #[error("{flag} must be a finite number greater than 0, got {value}")]
    Perplexity { flag: &'static str, value: f64 },
    #[error("{flag} must be a ratio in [0, 1] (0.92) or a percent in (1, 100] (92), got {value}")]
    Acceptance { flag: &'static str, value: f64 },
}

/// Policy of a format (case-insensitive).
pub fn policy(format: &str) -> Result<Policy, InputError> {
    POLICIES
        .iter()
        .find(|p| p.format.eq_ignore_ascii_case(format.trim()))
        .copied()
        .ok_or_else(|| InputError::UnknownFormat(format.to_string()))
}

/// Normalize an acceptance rate to percent: values ≤ 1 are ratios, values in (1, 100] percent.
pub fn acceptance_percent(flag: &'static str, value: f64) -> Result<f64, InputError> {
    if !value.is_finite() || !(0.0..=100.0).contains(&value) {
        return Err(InputError::Acceptance { flag, value });
    }
    Ok(if value <= 1.0 { value * 100.0 } else { value })
}

fn perplexity(flag: &'static str, value: f64) -> Result<f64, InputError> {
    if !value.is_finite() || value <= 0.0 {
        return Err(InputError::Perplexity { flag, value });
    }
    Ok(value)
}

/// Inputs as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Inputs {
    pub baseline_perplexity: f64,
    pub candidate_perplexity: f64,
    pub baseline_acceptance: f64,
    pub candidate_acceptance: f64,
}

/// The verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    pub policy: Policy,
    pub baseline_perplexity: f64,
    pub candidate_perplexity: f64,
    /// Percent; negative when the candidate is better.
    pub perplexity_regression_percent: f64,
    /// Percent (normalized from ratio input).
    pub baseline_acceptance_percent: f64,
    pub candidate_acceptance_percent: f64,
    /// Percentage points; negative when the candidate is better.
    pub acceptance_drop_pp: f64,
    pub passed: bool,
    /// One line per violated threshold.
    pub failures: Vec<String>,
}

/// Apply the policy of `format` to the inputs.
pub fn evaluate(format: &str, i: Inputs) -> Result<Verdict, InputError> {
    let policy = policy(format)?;
    let bp = perplexity("--baseline-perplexity", i.baseline_perplexity)?;
    let cp = perplexity("--candidate-perplexity", i.candidate_perplexity)?;
    let ba = acceptance_percent("--baseline-acceptance", i.baseline_acceptance)?;
    let ca = acceptance_percent("--candidate-acceptance", i.candidate_acceptance)?;
    let regression = (cp - bp) / bp * 100.0;
    let drop = ba - ca;
    let mut failures = Vec::new();
    if regression > policy.max_perplexity_regression_percent + EPS {
        failures.push(format!(
            "perplexity regression {:+.2}% exceeds the {} maximum of +{:.2}% (baseline {}, candidate {})",
            regression, policy.format, policy.max_perplexity_regression_percent, bp, cp
        ));
    }
    if drop > policy.max_acceptance_drop_pp + EPS {
        failures.push(format!(
            "acceptance drop {:.2}pp exceeds the {} maximum of {:.2}pp (baseline {:.2}%, candidate {:.2}%)",
            drop, policy.format, policy.max_acceptance_drop_pp, ba, ca
        ));
    }
    Ok(Verdict {
        policy,
        baseline_perplexity: bp,
        candidate_perplexity: cp,
        perplexity_regression_percent: regression,
        baseline_acceptance_percent: ba,
        candidate_acceptance_percent: ca,
        acceptance_drop_pp: drop,
        passed: failures.is_empty(),
        failures,
    })
}

/// Human report; ends with `Result: PASS` or `Result: FAIL` followed by the `Failure:` lines.
pub fn render(v: &Verdict) -> String {
    let mut s = String::new();
    s.push_str(&format!("Format: {}\n", v.policy.format));
    s.push_str(&format!(
        "Perplexity: baseline {} -> candidate {} ({:+.2}%, max +{:.2}%)\n",
        v.baseline_perplexity,
        v.candidate_perplexity,
        v.perplexity_regression_percent,
        v.policy.max_perplexity_regression_percent
    ));
    s.push_str(&format!(
        "Acceptance: baseline {:.2}% -> candidate {:.2}% (drop {:.2}pp, max {:.2}pp)\n",
        v.baseline_acceptance_percent,
        v.candidate_acceptance_percent,
        v.acceptance_drop_pp,
        v.policy.max_acceptance_drop_pp
    ));
    if v.passed {
        s.push_str("Result: PASS\n");
    } else {
        s.push_str("Result: FAIL\n");
        for f in &v.failures {
            s.push_str(&format!("Failure: {f}\n"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(bp: f64, cp: f64, ba: f64, ca: f64) -> Inputs {
        Inputs {
            baseline_perplexity: bp,
            candidate_perplexity: cp,
            baseline_acceptance: ba,
            candidate_acceptance: ca,
        }
    }

    #[test]
    fn a_gguf_within_its_limits_passes() {
        let v = evaluate("GGUF", inputs(9.50, 10.10, 94.0, 92.0)).unwrap();
        assert!(v.passed, "{v:?}");
        assert!(render(&v).ends_with("Result: PASS\n"));
    }

    #[test]
    fn table_has_the_documented_limits() {
        let want = [
            ("GGUF", 10.0, 3.0),
            ("AWQ", 7.0, 2.0),
            ("GPTQ", 8.0, 2.5),
            ("EXL2", 6.0, 2.0),
            ("FP8", 5.0, 1.5),
        ];
        assert_eq!(POLICIES.len(), want.len());
        for (f, ppl, acc) in want {
            let p = policy(f).unwrap();
            assert_eq!(p.max_perplexity_regression_percent, ppl, "{f}");
            assert_eq!(p.max_acceptance_drop_pp, acc, "{f}");
            assert_eq!(policy(&f.to_lowercase()).unwrap(), p);
        }
        assert!(matches!(
            policy("COMPRESSED_TENSORS"),
            Err(InputError::UnknownFormat(_))
        ));
    }

    /// Every threshold: exactly on it passes, just over it fails with one Failure line naming
    /// the observed and allowed values.
    #[test]
    fn every_threshold_edge() {
        for p in POLICIES {
            let base = 10.0;
            let on = base * (1.0 + p.max_perplexity_regression_percent / 100.0);
            let v = evaluate(p.format, inputs(base, on, 90.0, 90.0)).unwrap();
            assert!(v.passed, "{} ppl on threshold: {v:?}", p.format);
            let over = base * (1.0 + (p.max_perplexity_regression_percent + 0.01) / 100.0);
            let v = evaluate(p.format, inputs(base, over, 90.0, 90.0)).unwrap();
            assert!(!v.passed, "{} ppl over threshold", p.format);
            assert_eq!(v.failures.len(), 1);
            assert!(v.failures[0].starts_with("perplexity regression"));
            assert!(
                v.failures[0].contains(&format!("+{:.2}%", p.max_perplexity_regression_percent)),
                "{}",
                v.failures[0]
            );

            let v = evaluate(
                p.format,
                inputs(base, base, 90.0, 90.0 - p.max_acceptance_drop_pp),
            )
            .unwrap();
            assert!(v.passed, "{} acceptance on threshold: {v:?}", p.format);
            let v = evaluate(
                p.format,
                inputs(base, base, 90.0, 90.0 - p.max_acceptance_drop_pp - 0.01),
            )
            .unwrap();
            assert!(!v.passed, "{} acceptance over threshold", p.format);
            assert_eq!(v.failures.len(), 1);
            assert!(v.failures[0].starts_with("acceptance drop"));
            assert!(v.failures[0].contains(&format!("{:.2}pp", p.max_acceptance_drop_pp)));

            // both violated → two Failure lines
            let v = evaluate(p.format, inputs(base, base * 2.0, 90.0, 50.0)).unwrap();
            assert_eq!(v.failures.len(), 2);
            let text = render(&v);
            assert!(text.contains("Result: FAIL\nFailure: perplexity"));
            assert_eq!(text.matches("Failure: ").count(), 2);
        }
    }

    #[test]
    fn ratio_and_percent_are_equivalent() {
        let a = evaluate("GPTQ", inputs(9.5, 10.0, 0.94, 0.92)).unwrap();
        let b = evaluate("GPTQ", inputs(9.5, 10.0, 94.0, 92.0)).unwrap();
        let c = evaluate("GPTQ", inputs(9.5, 10.0, 0.94, 92.0)).unwrap();
        for v in [&a, &b, &c] {
            assert!((v.acceptance_drop_pp - 2.0).abs() < 1e-9, "{v:?}");
            assert!(v.passed);
        }
        // 1.0 is a ratio (100%), not 1%
        assert_eq!(acceptance_percent("x", 1.0).unwrap(), 100.0);
        let v = evaluate("FP8", inputs(9.5, 9.5, 1.0, 0.98)).unwrap();
        assert!(!v.passed, "100% → 98% is a 2pp drop > 1.5pp");
    }

    #[test]
    fn improvements_pass() {
        let v = evaluate("FP8", inputs(10.0, 9.0, 90.0, 95.0)).unwrap();
        assert!(v.passed);
        assert!(v.perplexity_regression_percent < 0.0);
        assert!(v.acceptance_drop_pp < 0.0);
    }

    #[test]
    fn bad_inputs() {
        assert!(matches!(
            evaluate("GGUF", inputs(0.0, 1.0, 90.0, 90.0)),
            Err(InputError::Perplexity {
                flag: "--baseline-perplexity",
                ..
            })
        ));
        assert!(matches!(
            evaluate("GGUF", inputs(1.0, f64::NAN, 90.0, 90.0)),
            Err(InputError::Perplexity {
                flag: "--candidate-perplexity",
                ..
            })
        ));
        assert!(matches!(
            evaluate("GGUF", inputs(1.0, 1.0, 101.0, 90.0)),
            Err(InputError::Acceptance {
                flag: "--baseline-acceptance",
                ..
            })
        ));
        assert!(matches!(
            evaluate("GGUF", inputs(1.0, 1.0, 90.0, -0.5)),
            Err(InputError::Acceptance {
                flag: "--candidate-acceptance",
                ..
            })
        ));
        assert!(evaluate("MP3", inputs(1.0, 1.0, 90.0, 90.0)).is_err());
    }
}
