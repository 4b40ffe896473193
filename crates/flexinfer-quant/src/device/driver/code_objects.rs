//! Where the HIP session finds its code objects (`gptq-<gfx>.hsaco`, compiled offline by
//! `scripts/hip/build-code-objects.sh`), and in which order it tries them.
//!
//! - **Embedded** in the binary at build time (`build.rs`, from `$FLEXINFER_HIP_CODE_OBJECTS`): the worker
//!   images' binary carries gfx1100 and gfx906 this way, so every image holds the same binary.
//! - **Files** of `$FLEXINFER_KERNEL_DIR` at run time, tried before the embedded ones: for a binary built
//!   without them, or to try a rebuilt code object without relinking.
//!
//! A code object of the wrong target does not load (`hipModuleLoadData` refuses it), so trying each one in
//! turn finds the device's. The embedded ones are ordered by the targets the node's KFD topology lists
//! (`/sys/class/kfd/kfd/topology/nodes/*/properties`, `gfx_target_version`), the GPUs this container was
//! given first (their `drm_render_minor` is a `/dev/dri/renderD<minor>` here: the device plugin mounts only
//! the pod's), so the device's own target is normally the first and only load, on a node with mixed cards
//! too.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

// The table build.rs writes (`EMBEDDED_HIP_CODE_OBJECTS`).
include!(concat!(env!("OUT_DIR"), "/hip_code_objects.rs")); // not-contract: cargo's build-script directory

/// Environment variable naming a directory of HIP code objects tried before the embedded ones.
pub const KERNEL_DIR_ENV: &str = "FLEXINFER_KERNEL_DIR";
/// The KFD topology of the node (sysfs), read for the AMD targets present.
pub const KFD_TOPOLOGY: &str = "/sys/class/kfd/kfd/topology/nodes";
/// The DRM device directory, whose `renderD<minor>` files are the GPUs this container was given.
pub const DRI_DIR: &str = "/dev/dri";

/// One HIP code object the session may load.
#[derive(Debug, Clone, PartialEq)]
pub enum CodeObjectSource {
    /// A `gptq-<gfx>.hsaco` file.
    File(PathBuf),
    /// Embedded in this binary at build time.
    Embedded {
        target: &'static str,
        bytes: &'static [u8],
    },
}

impl CodeObjectSource {
    /// How the device name and errors name it.
    pub fn describe(&self) -> String {
        match self {
            CodeObjectSource::File(p) => p.display().to_string(),
            CodeObjectSource::Embedded { target, .. } => format!("embedded gptq-{target}.hsaco"),
        }
    }

    /// The code object's bytes.
    pub fn read(&self) -> std::io::Result<Cow<'static, [u8]>> {
        match self {
            CodeObjectSource::File(p) => std::fs::read(p).map(Cow::Owned),
            CodeObjectSource::Embedded { bytes, .. } => Ok(Cow::Borrowed(bytes)),
        }
    }
}

/// The AMD targets embedded in this binary, sorted.
pub fn embedded_targets() -> Vec<&'static str> {
    EMBEDDED_HIP_CODE_OBJECTS.iter().map(|(t, _)| *t).collect()
}

/// The order in which the session tries code objects: the `gptq-*.hsaco` files of `dir` (sorted by name),
/// then the `embedded` ones, those whose target is in `preferred` first (in `preferred`'s order), the rest in
/// their own order.
pub fn code_object_sources(
    dir: Option<&Path>,
    embedded: &'static [(&'static str, &'static [u8])],
    preferred: &[String],
) -> Vec<CodeObjectSource> {
    let mut files = dir.map(code_object_files).unwrap_or_default();
    files.sort();
    let rank = |t: &str| {
        preferred
            .iter()
            .position(|p| p == t)
            .unwrap_or(preferred.len())
    };
    let mut inside: Vec<_> = embedded.iter().enumerate().collect();
    inside.sort_by_key(|(i, (t, _))| (rank(t), *i));
    files
        .into_iter()
        .map(CodeObjectSource::File)
        .chain(
            inside
                .into_iter()
                .map(|(_, (target, bytes))| CodeObjectSource::Embedded { target, bytes }),
        )
        .collect()
}

/// The `gptq-*.hsaco` files of `dir`.
pub fn code_object_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap_or_default().to_string_lossy();
            n.starts_with("gptq-") && n.ends_with(".hsaco")
        })
        .collect()
}

/// The AMD targets (`gfx1100`, `gfx906`, …) of the GPU nodes in a KFD topology directory without repeats:
/// first those whose `drm_render_minor` has a `renderD<minor>` in `dri` (the GPUs of this container), then
/// the others, each group in node order; empty when the topology cannot be read (no AMD driver, not Linux).
pub fn kfd_targets(topology: &Path, dri: &Path) -> Vec<String> {
    let mine: Vec<u32> = std::fs::read_dir(dri)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix("renderD")?
                .parse()
                .ok()
        })
        .collect();
    let mut nodes: Vec<(u64, PathBuf)> = std::fs::read_dir(topology)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().parse::<u64>().ok()?;
            Some((n, e.path().join("properties")))
        })
        .collect();
    nodes.sort();
    let mut gpus: Vec<(bool, String)> = Vec::new();
    for (_, props) in nodes {
        let Ok(text) = std::fs::read_to_string(&props) else {
            continue;
        };
        let field = |name: &str| {
            text.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == name).then(|| v.trim().parse::<u32>().ok()).flatten()
            })
        };
        if let Some(t) = field("gfx_target_version").and_then(gfx_name) {
            let given = field("drm_render_minor").is_some_and(|m| mine.contains(&m));
            gpus.push((given, t));
        }
    }
    // Stable: the container's GPUs first, node order kept within each group.
    gpus.sort_by_key(|(given, _)| !*given);
    let mut targets: Vec<String> = Vec::new();
    for (_, t) in gpus {
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    targets
}

/// The target name of a KFD `gfx_target_version` (major·10000 + minor·100 + stepping; 0 for a CPU node):
/// 110000 → `gfx1100`, 90006 → `gfx906`, 90010 → `gfx90a`.
pub fn gfx_name(version: u32) -> Option<String> {
    let (major, minor, stepping) = (version / 10000, version / 100 % 100, version % 100);
    if major == 0 || minor > 15 || stepping > 15 {
        return None;
    }
    Some(format!("gfx{major}{minor:x}{stepping:x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kfd_versions_name_their_targets() {
        for (v, t) in [
            (110000, Some("gfx1100")),
            (90006, Some("gfx906")),
            (90010, Some("gfx90a")),
            (110001, Some("gfx1101")),
            (100300, Some("gfx1030")),
            (0, None),
            (90016, None),
        ] {
            assert_eq!(gfx_name(v).as_deref(), t, "{v}");
        }
    }

    #[test]
    fn the_topology_lists_each_gpu_target_once_the_container_s_own_first() -> std::io::Result<()> {
        let d = tempfile::tempdir()?;
        let topo = d.path().join("nodes");
        let dri = d.path().join("dri");
        std::fs::create_dir_all(&dri)?;
        // node 0: the CPU (gfx_target_version 0); 1 and 2: gfx906 (render minors 128, 129); 10: gfx1100
        // (minor 130); a stray file and a node without properties are skipped.
        for (node, props) in [
            (
                "0",
                "cpu_cores_count 16\ngfx_target_version 0\ndrm_render_minor 0\n",
            ),
            (
                "1",
                "simd_count 240\ngfx_target_version 90006\ndrm_render_minor 128\n",
            ),
            (
                "10",
                "gfx_target_version 110000\nmax_waves_per_simd 16\ndrm_render_minor 130\n",
            ),
            ("2", "gfx_target_version 90006\ndrm_render_minor 129\n"),
        ] {
            std::fs::create_dir_all(topo.join(node))?;
            std::fs::write(topo.join(node).join("properties"), props)?;
        }
        std::fs::create_dir(topo.join("3"))?;
        std::fs::write(topo.join("generation_id"), "1\n")?;
        // No render node here (or none of the topology's): node order.
        assert_eq!(kfd_targets(&topo, &dri), ["gfx906", "gfx1100"]);
        std::fs::write(dri.join("card0"), "")?;
        std::fs::write(dri.join("renderD200"), "")?;
        assert_eq!(kfd_targets(&topo, &dri), ["gfx906", "gfx1100"]);
        // The pod was given the gfx1100 (renderD130): its target first.
        std::fs::write(dri.join("renderD130"), "")?;
        assert_eq!(kfd_targets(&topo, &dri), ["gfx1100", "gfx906"]);
        // Given a gfx906 too: both of the container's, in node order.
        std::fs::write(dri.join("renderD129"), "")?;
        assert_eq!(kfd_targets(&topo, &dri), ["gfx906", "gfx1100"]);
        assert!(kfd_targets(&d.path().join("missing"), &dri).is_empty());
        Ok(())
    }

    static TWO: [(&str, &[u8]); 2] = [("gfx1100", b"a"), ("gfx906", b"b")];

    fn described(s: &[CodeObjectSource]) -> Vec<String> {
        s.iter().map(CodeObjectSource::describe).collect()
    }

    #[test]
    fn files_of_the_kernel_dir_come_first_then_the_node_s_own_target() -> std::io::Result<()> {
        let d = tempfile::tempdir()?;
        for f in [
            "gptq-gfx906.hsaco",
            "gptq-gfx1100.hsaco",
            "notes.txt",
            "gptq-x.s",
        ] {
            std::fs::write(d.path().join(f), b"x")?;
        }
        let p = |f: &str| d.path().join(f).display().to_string();
        let gfx906 = ["gfx906".to_string()];
        assert_eq!(
            described(&code_object_sources(Some(d.path()), &TWO, &gfx906)),
            [
                p("gptq-gfx1100.hsaco"),
                p("gptq-gfx906.hsaco"),
                "embedded gptq-gfx906.hsaco".into(),
                "embedded gptq-gfx1100.hsaco".into(),
            ]
        );
        // No directory, no topology: the embedded ones in their own order; an unknown target changes nothing.
        for preferred in [vec![], vec!["gfx90a".to_string()]] {
            assert_eq!(
                described(&code_object_sources(None, &TWO, &preferred)),
                ["embedded gptq-gfx1100.hsaco", "embedded gptq-gfx906.hsaco"]
            );
        }
        // A missing directory adds nothing; nothing embedded and no directory: nothing to try.
        assert_eq!(
            code_object_sources(Some(&d.path().join("missing")), &TWO, &gfx906).len(),
            2
        );
        assert!(code_object_sources(None, &[], &gfx906).is_empty());
        assert_eq!(
            code_object_sources(None, &TWO, &gfx906)[0].read()?.as_ref(),
            b"b"
        );
        Ok(())
    }
}
