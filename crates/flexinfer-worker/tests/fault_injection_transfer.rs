//! Fault injection on the real worker binary for the transfer phases: SIGKILL `download` (hub source,
//! into a new generation beside a promoted one) and `publish` (to a real registry) at seeded points of
//! their run, then let a new process finish, as a restarted pod would. After every kill: the download's
//! files are byte-identical to the source and each verifies on disk against `.source-integrity.json`, no
//! `.part` or lock entry is left, the promoted generation beside it is untouched; the published
//! artifact pulls back byte-identical under the same manifest digest and the published directory is
//! unchanged. The counts go to docs/benchmarks.md ("Reliability").
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod download_support;
mod fault_support;
mod publish_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use download_support::*;
use fault_support::{check, fraction, Tally};
use publish_support::Registry;

const REPO: &str = "acme/fault-llama";
const MARKERS: &[&str] = &[".source-integrity.json", ".download_complete"];

/// Runs `make()` to completion once (the reference duration), then for every random seed: spawn, SIGKILL at
/// the fraction of that duration the random seed picks, and hand the result to `after` (which restarts and checks).
fn kill_at_seeds(
    seeds: std::ops::Range<u64>,
    full: Duration,
    mut make: impl FnMut(u64) -> Command,
    mut after: impl FnMut(u64, &mut Tally),
) -> Tally {
    let mut t = Tally::default();
    for seed in seeds {
        let mut child = make(seed)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(full.mul_f64(fraction(seed)));
        if child.try_wait().unwrap().is_none() {
            t.killed_mid_run += 1;
        }
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        t.points += 1;
        after(seed, &mut t);
    }
    t
}

/// Every file `.source-integrity.json` lists has its recorded size and sha256 on disk, and the record
/// lists every file of the directory.
fn integrity_verifies(dir: &Path) -> bool {
    let Ok(b) = std::fs::read(dir.join(".source-integrity.json")) else {
        return false;
    };
    let rec: serde_json::Value = serde_json::from_slice(&b).unwrap();
    let files = rec["files"].as_array().cloned().unwrap_or_default();
    let on_disk = tree(dir, MARKERS);
    files.len() == on_disk.len()
        && files.iter().all(|f| {
            let name = f["name"].as_str().unwrap_or_default();
            on_disk.get(name).map(String::as_str) == f["sha256"].as_str()
                && std::fs::metadata(dir.join(name))
                    .is_ok_and(|m| Some(m.len()) == f["size"].as_u64())
        })
}

/// `.part` files inside `dir` and lock entries beside it.
fn leftovers(dir: &Path) -> usize {
    let parts = tree(dir, &[])
        .keys()
        .filter(|k| k.ends_with(".part"))
        .count();
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let locks = std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n == format!(".{name}.lock")
        })
        .count();
    parts + locks
}

fn generation(n: u64) -> String {
    format!("source.{:08x}-{:014}", n + 1, 20261201000000 + n)
}

#[test]
fn download_killed_at_seeded_points_finishes_verified_beside_the_promoted_generation() {
    let tmp = tempfile::tempdir().unwrap();
    // The revision being downloaded, and an older one already promoted beside it (different shards,
    // so the runs really fetch; the small files are linked from it).
    let src = tmp.path().join("src");
    write_data(&src.join("model-00001-of-00002.safetensors"), 12 << 20, 41);
    write_data(&src.join("model-00002-of-00002.safetensors"), 3 << 20, 42);
    std::fs::write(src.join("config.json"), r#"{"hidden_size":64}"#).unwrap();
    std::fs::create_dir_all(src.join("tokenizer")).unwrap();
    write_data(&src.join("tokenizer/vocab.txt"), 200_000, 43);
    let old = tmp.path().join("old");
    write_data(&old.join("model-00001-of-00002.safetensors"), 12 << 20, 51);
    std::fs::write(old.join("config.json"), r#"{"hidden_size":64}"#).unwrap();
    let (new_files, old_files) = (describe(&src), describe(&old));
    let want: BTreeMap<String, String> = new_files
        .iter()
        .map(|f| (f.path.clone(), f.sha256.clone()))
        .collect();
    let hub = start_hub(REPO, vec![("main", new_files), ("old", old_files)]);
    hub.state.faults.lock().unwrap().throttle = Some(24 << 20);
    let root = tmp.path().join("pvc/m");
    let scratch = tmp.path().to_path_buf();
    let cmd = |revision: &str, out: &Path, keep: &str| {
        let mut c = worker("download", &scratch);
        c.env("SOURCE", format!("HF://{REPO}"))
            .env("REVISION", revision)
            .env("MODEL_DIR", &root)
            .env("OUT_DIR", out)
            .env("HF_ENDPOINT", hub.endpoint())
            .env("FLEXINFER_KEEP_DIRS", keep)
            .env("FLEXINFER_DOWNLOAD_RETRIES", "4");
        c
    };
    let promoted = root.join(generation(0));
    let keep_promoted = format!("m/{}", generation(0));
    let st = cmd("old", &promoted, &keep_promoted).output().unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let previous = tree(&promoted, &[]);
    // The uninterrupted reference run, and its duration.
    let reference = root.join(generation(99));
    let t0 = Instant::now();
    let keep = |g: &Path| {
        format!(
            "{keep_promoted},m/{}",
            g.file_name().unwrap().to_string_lossy()
        )
    };
    let st = cmd("main", &reference, &keep(&reference)).output().unwrap();
    let full = t0.elapsed();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    assert_eq!(tree(&reference, MARKERS), want);
    std::fs::remove_dir_all(&reference).unwrap();

    let out_of = |seed: u64| root.join(generation(seed + 1));
    let t = kill_at_seeds(
        0..12,
        full,
        |seed| cmd("main", &out_of(seed), &keep(&out_of(seed))),
        |seed, t| {
            let out = out_of(seed);
            let r = cmd("main", &out, &keep(&out)).output().unwrap();
            let got = tree(&out, MARKERS);
            if !r.status.success() || got != want {
                let diff: Vec<&String> = want
                    .keys()
                    .chain(got.keys())
                    .filter(|k| want.get(*k) != got.get(*k))
                    .collect();
                eprintln!(
                    "download seed {seed}: {}, differing files {diff:?}\n{}",
                    r.status,
                    String::from_utf8_lossy(&r.stderr)
                );
                t.lost_or_different += 1;
            }
            if !integrity_verifies(&out) || !out.join(".download_complete").is_file() {
                t.unverified += 1;
            }
            t.leftovers += leftovers(&out);
            if tree(&promoted, &[]) != previous {
                t.previous_changed += 1;
            }
            // A finished generation would be a link source for the next seed: remove it.
            std::fs::remove_dir_all(&out).unwrap();
        },
    );
    check("download", &t, 6);
}

#[test]
fn publish_killed_at_seeded_points_finishes_with_the_same_manifest() {
    let reg = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let src: PathBuf = tmp.path().join("out");
    write_safetensors(&src.join("model-00001-of-00002.safetensors"), 16 << 20, 61);
    write_safetensors(&src.join("model-00002-of-00002.safetensors"), 2 << 20, 62);
    std::fs::write(
        src.join("config.json"),
        r#"{"quantization_config":{"bits":4}}"#,
    )
    .unwrap();
    std::fs::write(src.join("tokenizer.json"), r#"{"model":{}}"#).unwrap();
    let want = tree(&src, &[]);
    let scratch = tmp.path().to_path_buf();
    let publish = |repo: &str| {
        let mut c = worker("publish", &scratch);
        c.env("MODEL_DIR", &src)
            .env("OCI_REF", format!("{}/{repo}:v1", reg.addr))
            .env("OCI_INSECURE", "true");
        c
    };
    let t0 = Instant::now();
    let r = run(publish("flexinfer/reference"), tmp.path());
    let full = t0.elapsed();
    assert_eq!(r.code, 0, "{}\n{}", r.describe(), reg.log_text());
    let digest = r.termination["digest"].as_str().unwrap().to_string();

    let t = kill_at_seeds(
        0..10,
        full,
        |seed| publish(&format!("flexinfer/fault-{seed}")),
        |seed, t| {
            let repo = format!("flexinfer/fault-{seed}");
            let r = run(publish(&repo), tmp.path());
            let same = r.code == 0 && r.termination["digest"] == digest.as_str();
            // What a consumer pulls: every layer verified against its digest by `download`.
            let pulled = tmp.path().join(format!("pulled-{seed}"));
            let mut c = worker("download", tmp.path());
            c.env("SOURCE", format!("oci://{}/{repo}:v1", reg.addr))
                .env("MODEL_DIR", &pulled)
                .env("OCI_INSECURE", "true");
            let p = run(c, tmp.path());
            if !same || p.code != 0 || tree(&pulled, MARKERS) != want {
                eprintln!("publish seed {seed}: {}\n{}", r.describe(), p.describe());
                t.lost_or_different += 1;
            }
            if tree(&src, &[]) != want {
                t.previous_changed += 1;
            }
            let _ = std::fs::remove_dir_all(&pulled);
        },
    );
    check("publish", &t, 5);
}
