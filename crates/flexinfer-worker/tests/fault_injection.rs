//! Fault injection on the real worker binary: SIGKILL `quantize` and `abliterate` at seeded points of
//! their run (calibration, layers, save, rename), then let a new process finish, as a restarted pod
//! would. After every kill: the finished artifact is byte-identical to an uninterrupted run's, its
//! `.save-complete` verifies, no staging or lock entry is left, and a previously promoted artifact beside
//! it is untouched. The counts go to docs/benchmarks.md ("Reliability").
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod abliterate_support;
mod fault_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use abliterate_support::{build, checksums, TinyModel, TinyOpts};
use fault_support::{check, fraction, Tally};
use flexinfer_contract::env;

/// The environment of one phase's worker (paths and the small settings of these tests).
fn command(phase: &str, m: &TinyModel, calib: &Path, out: &Path, term: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flexinfer-worker"));
    c.arg(phase)
        .env_clear()
        .env(env::MODEL_DIR, &m.dir)
        .env(env::OUT_DIR, out)
        .env(env::TERMINATION_LOG, term)
        .env(env::TELEMETRY, "false")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match phase {
        "quantize" => {
            c.env(env::DATASET, calib)
                .env(env::GROUP_SIZE, "32")
                .env(env::MAX_SAMPLES, "16")
                .env(env::MAX_SEQ_LEN, "64");
        }
        _ => {
            c.env(env::REFUSAL_DATASET, &m.refusal)
                .env(env::HARMLESS_DATASET, &m.harmless)
                .env(env::NUM_SAMPLES, "24");
        }
    }
    c
}

/// Files whose bytes must match between runs (markers with timestamps are checked separately).
fn payload(dir: &Path) -> BTreeMap<String, String> {
    checksums(dir)
        .into_iter()
        .filter(|(k, _)| {
            ![
                ".save-complete",
                ".abliteration-status.json",
                ".abliteration-manifest.json",
            ]
            .contains(&k.as_str())
        })
        .collect()
}

/// Every shard `.save-complete` lists has its recorded size and sha256.
fn save_complete_verifies(dir: &Path) -> bool {
    let Ok(b) = std::fs::read(dir.join(".save-complete")) else {
        return false;
    };
    let sc: serde_json::Value = serde_json::from_slice(&b).unwrap();
    sc["shards"].as_array().is_some_and(|shards| {
        !shards.is_empty()
            && shards.iter().all(|s| {
                let p = dir.join(s["name"].as_str().unwrap_or_default());
                std::fs::metadata(&p).is_ok_and(|m| Some(m.len()) == s["size_bytes"].as_u64())
                    && flexinfer_fsutil::sha256_file(&p).ok().as_deref() == s["sha256"].as_str()
            })
    })
}

/// Entries beside `out` that a finished run must not leave: its staging directory or its lock.
fn leftovers(out: &Path) -> Vec<String> {
    let name = out.file_name().unwrap().to_string_lossy().to_string();
    std::fs::read_dir(out.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| *n == format!(".{name}.partial") || *n == format!(".{name}.lock"))
        .collect()
}

/// A small calibration dataset beside the model.
fn calibration_file(m: &TinyModel) -> PathBuf {
    let calib = m.root.path().join("calib.jsonl");
    let lines: Vec<String> = flexinfer_quant::testkit::sentences(3, 48)
        .into_iter()
        .map(|s| serde_json::json!({ "text": s }).to_string())
        .collect();
    std::fs::write(&calib, lines.join("\n") + "\n").unwrap();
    calib
}

fn inject(phase: &str, seeds: std::ops::Range<u64>, out_name: &str) -> Tally {
    let m = build(&TinyOpts::default());
    let calib = calibration_file(&m);
    let term = m.root.path().join("term.json");
    let cache = m.dir.join(".flexinfer-gptq-cache");
    let fresh = |p: &Path| {
        let _ = std::fs::remove_dir_all(p);
        let _ = std::fs::remove_dir_all(&cache);
    };
    // The uninterrupted reference, and its duration.
    let reference: PathBuf = m.dir.join(format!("{out_name}.reference"));
    let t0 = Instant::now();
    let st = command(phase, &m, &calib, &reference, &term)
        .status()
        .unwrap();
    assert!(st.success(), "{phase} reference run failed");
    let full = t0.elapsed();
    let want = payload(&reference);
    // A promoted artifact of an earlier generation beside the runs (the reference itself).
    let previous = checksums(&reference);
    let mut t = Tally::default();
    for seed in seeds {
        let out = m.dir.join(format!("{out_name}.s{seed}"));
        fresh(&out);
        let mut child = command(phase, &m, &calib, &out, &term).spawn().unwrap();
        std::thread::sleep(full.mul_f64(fraction(seed)));
        if child.try_wait().unwrap().is_none() {
            t.killed_mid_run += 1;
        }
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        t.points += 1;
        // The restarted pod.
        let st = command(phase, &m, &calib, &out, &term).status().unwrap();
        if !st.success() || payload(&out) != want {
            let got = payload(&out);
            let diff: Vec<&String> = want
                .keys()
                .chain(got.keys())
                .filter(|k| want.get(*k) != got.get(*k))
                .collect();
            eprintln!("{phase} seed {seed}: exit {st}, differing files {diff:?}");
            t.lost_or_different += 1;
        }
        if phase == "quantize" && !save_complete_verifies(&out) {
            t.unverified += 1;
        }
        t.leftovers += leftovers(&out).len();
        // A finished quantize leaves no layer cache in the model directory.
        if phase == "quantize" && cache.exists() {
            eprintln!(
                "{phase} seed {seed}: the layer cache {} is left",
                cache.display()
            );
            t.leftovers += 1;
        }
        if checksums(&reference) != previous {
            t.previous_changed += 1;
        }
        let _ = std::fs::remove_dir_all(&out);
    }
    eprintln!(
        "fault injection {phase}: {} kill points ({} mid-run, run {:.2}s), {} lost or different, {} unverified, {} leftovers, {} previous changed",
        t.points,
        t.killed_mid_run,
        full.as_secs_f64(),
        t.lost_or_different,
        t.unverified,
        t.leftovers,
        t.previous_changed
    );
    t
}

#[test]
fn quantize_killed_at_seeded_points_finishes_byte_identical() {
    let t = inject("quantize", 0..14, "gptq-w4-g32");
    check("quantize", &t, 5);
}

#[test]
fn abliterate_killed_at_seeded_points_finishes_byte_identical() {
    let t = inject("abliterate", 100..110, "abliterated");
    check("abliterate", &t, 3);
}

#[test]
fn kill_points_cover_the_run() {
    let f: Vec<f64> = (0..12).map(fraction).collect();
    assert!(f.iter().all(|x| (0.02..1.1).contains(x)), "{f:?}");
    assert!(
        f.iter().any(|x| *x < 0.3) && f.iter().any(|x| *x > 0.7),
        "{f:?}"
    );
}

/// SIGTERM (a deleted Job or pod, a drained node) stops a quantize at once with exit 143 and a termination
/// message that says so, keeping its per-layer cache: the restarted run resumes and ends byte-identical to
/// an uninterrupted one. Without the worker's handler the process would die by the signal itself (no exit
/// code, no message) here, or — as PID 1 of a container, which ignores SIGTERM — run on until SIGKILL.
#[test]
fn quantize_stopped_by_sigterm_exits_143_and_its_restart_resumes() {
    let m = build(&TinyOpts::default());
    let calib = calibration_file(&m);
    let term = m.root.path().join("term.json");
    let reference = m.dir.join("gptq-w4-g32.reference");
    assert!(command("quantize", &m, &calib, &reference, &term)
        .status()
        .unwrap()
        .success());
    let _ = std::fs::remove_file(&term);

    let out = m.dir.join("gptq-w4-g32.term");
    let manifest = m.dir.join(".flexinfer-gptq-cache/layers/manifest.json");
    let layers = || -> usize {
        std::fs::read(&manifest)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["layers"].as_array().map(Vec::len))
            .unwrap_or(0)
    };
    let mut child = command("quantize", &m, &calib, &out, &term)
        .spawn()
        .unwrap();
    // Once a layer is cached (calibration is done, the handler long installed), before the run ends.
    while layers() == 0 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before a layer was cached"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(143), "exit status after SIGTERM: {st}");
    let msg: serde_json::Value = serde_json::from_slice(&std::fs::read(&term).unwrap()).unwrap();
    assert_eq!(msg["exitCode"], 143, "{msg}");
    assert_eq!(msg["phase"], "quantization", "{msg}");
    assert!(
        msg["error"]
            .as_str()
            .unwrap_or_default()
            .contains("SIGTERM"),
        "{msg}"
    );
    assert!(layers() >= 1, "the layer cache was not kept");
    let cache = m.dir.join(".flexinfer-gptq-cache");
    let kept = m.root.path().join("kept-cache");
    assert!(Command::new("cp")
        .args([
            "-a",
            &cache.display().to_string(),
            &kept.display().to_string()
        ])
        .status()
        .unwrap()
        .success());
    assert!(
        command("quantize", &m, &calib, &out, &term)
            .status()
            .unwrap()
            .success(),
        "the restarted run failed"
    );
    assert_eq!(payload(&out), payload(&reference));
    assert!(save_complete_verifies(&out));
    assert!(!cache.exists(), "the finished run removes its layer cache");
    // As if killed between the save's rename and the cache's removal: the next run reuses the artifact and
    // removes the cache it finds (this configuration's), leaving the artifact as it was.
    std::fs::rename(&kept, &cache).unwrap();
    let out_before = payload(&out);
    let again = command("quantize", &m, &calib, &out, &term)
        .env(env::TELEMETRY, "true")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&again.stdout),
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(again.status.success(), "{said}");
    assert!(
        said.contains("quantization_cached") && said.contains("quantization_layer_cache_reset"),
        "the artifact was not reused, or the cache not reported: {said}"
    );
    assert!(!cache.exists(), "the leftover layer cache was not removed");
    assert_eq!(payload(&out), out_before);
}
