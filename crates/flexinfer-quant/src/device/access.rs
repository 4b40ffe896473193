//! Why a GPU runtime inside a pod may see no device, read from the device files.
//!
//! A vendor runtime that finds no device says only that (`hipErrorNoDevice`, `no HIP device`). In a pod the
//! cause is nearly always one of three, each visible in `/dev`:
//! - the pod did not get the GPU: no `/dev/kfd` (AMD) or `/dev/nvidia*` (NVIDIA) in the container;
//! - it got it, but the non-root worker (uid 65532) may not open it: AMD device nodes are `root:render` (or
//!   `video`) with mode 0660, and the pod is not in that group (the controller's
//!   `FLEXINFER_GPU_SUPPLEMENTAL_GROUPS`, chart value `gpuSupplementalGroups`);
//! - the image lacks the runtime: `/dev/kfd` is there but `libamdhip64` is not (the `cpu` worker image on an
//!   AMD node), or `/dev/nvidia*` is there but `libcuda.so.1` is not (the pod did not run under the NVIDIA
//!   container runtime, which mounts the host driver's library).
//!
//! [`observe`] reads the files (impure); [`hint`] turns what was seen into one sentence (pure, table-tested);
//! [`explain`] adds it to a probe's error. Nothing here opens a device.

use super::DeviceKind;
use super::ProbeError;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

/// One device file as the worker sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceFile {
    /// `/dev/kfd`, `/dev/dri/renderD128`, `/dev/nvidia0`, …
    pub path: String,
    /// Owning group.
    pub gid: u32,
    /// Permission bits (`0o660`).
    pub mode: u32,
    /// This process may open it for reading and writing (`access(R_OK | W_OK)`).
    pub usable: bool,
}

/// The process's user and groups (primary and supplementary).
#[derive(Clone, Debug, PartialEq)]
pub struct Identity {
    pub uid: u32,
    pub groups: Vec<u32>,
}

/// What [`hint`] reads: the device files of the kind's vendor under the device root.
#[derive(Clone, Debug, PartialEq)]
pub struct Seen {
    /// AMD: `/dev/kfd`, NVIDIA: `/dev/nvidiactl` (absent: the container has no such GPU).
    pub control: Option<DeviceFile>,
    /// AMD: `/dev/dri/renderD*`, NVIDIA: `/dev/nvidia0`, `/dev/nvidia1`, … (sorted).
    pub devices: Vec<DeviceFile>,
}

/// The kind's device files under `dev` (normally `/dev`).
pub fn observe(kind: DeviceKind, dev: &Path) -> Seen {
    let file = |p: &Path| -> Option<DeviceFile> {
        let m = std::fs::metadata(p).ok()?;
        Some(DeviceFile {
            path: p.display().to_string(),
            gid: m.gid(),
            mode: m.mode() & 0o7777,
            usable: may_read_write(p),
        })
    };
    let listed = |dir: &Path, keep: &dyn Fn(&str) -> bool| -> Vec<DeviceFile> {
        let mut v: Vec<DeviceFile> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| keep(&e.file_name().to_string_lossy()))
            .filter_map(|e| file(&e.path()))
            .collect();
        v.sort_by(|a, b| a.path.cmp(&b.path));
        v
    };
    match kind {
        DeviceKind::Hip => Seen {
            control: file(&dev.join("kfd")),
            devices: listed(&dev.join("dri"), &|n| n.starts_with("renderD")),
        },
        DeviceKind::Cuda => Seen {
            control: file(&dev.join("nvidiactl")),
            devices: listed(dev, &|n| {
                n.strip_prefix("nvidia")
                    .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
            }),
        },
        DeviceKind::Cpu => Seen {
            control: None,
            devices: Vec::new(),
        },
    }
}

/// `access(path, R_OK | W_OK)` with the process's real ids (those of the pod's user in a container).
fn may_read_write(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a NUL-terminated path that lives during the call; access(2) only reads it.
    unsafe { libc::access(c.as_ptr(), libc::R_OK | libc::W_OK) == 0 }
}

/// This process's uid and groups.
pub fn identity() -> Identity {
    // SAFETY: getuid/getgid cannot fail; getgroups writes at most `n` ids into a buffer of `n`.
    unsafe {
        let mut groups = vec![libc::getgid()];
        let n = libc::getgroups(0, std::ptr::null_mut());
        if n > 0 {
            let mut buf = vec![0 as libc::gid_t; n as usize];
            let got = libc::getgroups(n, buf.as_mut_ptr());
            if got > 0 {
                buf.truncate(got as usize);
                groups.extend(buf);
            }
        }
        groups.sort_unstable();
        groups.dedup();
        Identity {
            uid: libc::getuid(),
            groups,
        }
    }
}

/// One sentence on the device files that explains why `kind`'s runtime gives no device, or `None` when they
/// explain nothing. `runtime_loaded`: the runtime's library loaded (the failure came after it).
pub fn hint(kind: DeviceKind, seen: &Seen, who: &Identity, runtime_loaded: bool) -> Option<String> {
    let (vendor, control, resource) = match kind {
        DeviceKind::Hip => ("AMD", "/dev/kfd", "amd.com/gpu"),
        DeviceKind::Cuda => ("NVIDIA", "/dev/nvidiactl", "nvidia.com/gpu"),
        DeviceKind::Cpu => return None,
    };
    if !runtime_loaded {
        // The device is here but the runtime is not: the image (or, for NVIDIA, the container runtime).
        seen.control.as_ref()?;
        return Some(match kind {
            DeviceKind::Hip => "this container has an AMD GPU (/dev/kfd) but no HIP runtime: run a rocm-* \
                                worker image (docs/user/install.md, \"Worker image variants\")"
                .into(),
            _ => "this container has NVIDIA device files but no libcuda.so.1: the NVIDIA container runtime \
                  mounts the host driver's (runtimeClassName nvidia, or the NVIDIA container toolkit as \
                  the node's default runtime)"
                .into(),
        });
    }
    let Some(ctl) = &seen.control else {
        return Some(format!(
            "no {control} in this container: the pod did not get an {vendor} GPU (it must request \
             {resource}; the device plugin mounts the device files)"
        ));
    };
    if seen.devices.is_empty() {
        let which = match kind {
            DeviceKind::Hip => "/dev/dri/renderD*",
            _ => "/dev/nvidia<N>",
        };
        return Some(format!(
            "{} is present but no {which}: the device plugin gave this pod no {vendor} device",
            ctl.path
        ));
    }
    let blocked: Vec<&DeviceFile> = std::iter::once(ctl)
        .chain(&seen.devices)
        .filter(|f| !f.usable)
        .collect();
    if blocked.is_empty() {
        return None;
    }
    let files: Vec<String> = blocked
        .iter()
        .map(|f| format!("{} (group {}, mode {:04o})", f.path, f.gid, f.mode))
        .collect();
    let groups: Vec<String> = who.groups.iter().map(u32::to_string).collect();
    let mut missing: Vec<u32> = blocked
        .iter()
        .filter(|f| f.mode & 0o060 == 0o060 && !who.groups.contains(&f.gid))
        .map(|f| f.gid)
        .collect();
    missing.sort_unstable();
    missing.dedup();
    let fix = if missing.is_empty() {
        "adding a group would not help: the files' modes or the node (a read-only device mount, a \
         security module) refuse it, a node setting, not the pod's"
            .to_string()
    } else {
        let ids: Vec<String> = missing.iter().map(u32::to_string).collect();
        format!(
            "add group {} to the chart's gpuSupplementalGroups (FLEXINFER_GPU_SUPPLEMENTAL_GROUPS of the \
             controller), which every GPU pod gets as supplemental groups",
            ids.join(" and ")
        )
    };
    Some(format!(
        "uid {} (groups {}) may not open {}: {fix}",
        who.uid,
        groups.join(","),
        files.join(", ")
    ))
}

/// `e` with the device files' explanation added, when they give one (see [`hint`]); `dev` is the device root.
pub fn explain(kind: DeviceKind, e: ProbeError, dev: &Path) -> ProbeError {
    let loaded = match &e {
        ProbeError::NotLoaded(_) => false,
        ProbeError::NoDevice { .. } | ProbeError::Status { .. } => true,
        _ => return e,
    };
    match hint(kind, &observe(kind, dev), &identity(), loaded) {
        Some(hint) => ProbeError::Hint {
            probe: Box::new(e),
            hint,
        },
        None => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(path: &str, gid: u32, mode: u32, usable: bool) -> DeviceFile {
        DeviceFile {
            path: path.into(),
            gid,
            mode,
            usable,
        }
    }
    fn nonroot(groups: &[u32]) -> Identity {
        Identity {
            uid: 65532,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn the_device_files_explain_a_runtime_without_devices() {
        let kfd = |u| f("/dev/kfd", 110, 0o660, u);
        let render = |u| f("/dev/dri/renderD128", 110, 0o660, u);
        let amd = |c: Option<DeviceFile>, d: Vec<DeviceFile>| Seen {
            control: c,
            devices: d,
        };
        let nvidia = Seen {
            control: Some(f("/dev/nvidiactl", 0, 0o666, true)),
            devices: vec![f("/dev/nvidia0", 0, 0o666, true)],
        };
        let none = amd(None, vec![]);
        let me = nonroot(&[65532]);
        let cases: Vec<(&str, DeviceKind, &Seen, bool, Option<&str>)> = vec![
            // no runtime library, no device: nothing to say (a CPU node, the cpu image)
            ("cpu node", DeviceKind::Hip, &none, false, None),
            ("cpu node, cuda", DeviceKind::Cuda, &none, false, None),
            ("cpu kind", DeviceKind::Cpu, &nvidia, true, None),
        ];
        for (name, kind, seen, loaded, want) in &cases {
            assert_eq!(hint(*kind, seen, &me, *loaded).as_deref(), *want, "{name}");
        }
        let said = |kind, seen: &Seen, who: &Identity, loaded| {
            hint(kind, seen, who, loaded).unwrap_or_else(|| panic!("no hint for {seen:?}"))
        };
        // the cpu image on an AMD node
        let s = said(
            DeviceKind::Hip,
            &amd(Some(kfd(true)), vec![render(true)]),
            &me,
            false,
        );
        assert!(s.contains("no HIP runtime") && s.contains("rocm-*"), "{s}");
        // NVIDIA devices without the driver library
        let s = said(DeviceKind::Cuda, &nvidia, &me, false);
        assert!(
            s.contains("libcuda.so.1") && s.contains("runtimeClassName"),
            "{s}"
        );
        // runtime loaded, no device files: the pod got no GPU
        let s = said(DeviceKind::Hip, &none, &me, true);
        assert!(
            s.starts_with("no /dev/kfd") && s.contains("amd.com/gpu"),
            "{s}"
        );
        let s = said(DeviceKind::Cuda, &none, &me, true);
        assert!(
            s.starts_with("no /dev/nvidiactl") && s.contains("nvidia.com/gpu"),
            "{s}"
        );
        let s = said(DeviceKind::Hip, &amd(Some(kfd(true)), vec![]), &me, true);
        assert!(s.contains("no /dev/dri/renderD*"), "{s}");
        // not in the render group: names the files, the groups and the gid to add
        let s = said(
            DeviceKind::Hip,
            &amd(Some(kfd(false)), vec![render(false)]),
            &me,
            true,
        );
        assert_eq!(
            s,
            "uid 65532 (groups 65532) may not open /dev/kfd (group 110, mode 0660), /dev/dri/renderD128 \
             (group 110, mode 0660): add group 110 to the chart's gpuSupplementalGroups \
             (FLEXINFER_GPU_SUPPLEMENTAL_GROUPS of the controller), which every GPU pod gets as supplemental groups"
        );
        // kfd under render (110), renderD under video (44): both gids named, once each
        let s = said(
            DeviceKind::Hip,
            &amd(
                Some(kfd(false)),
                vec![
                    f("/dev/dri/renderD128", 44, 0o660, false),
                    f("/dev/dri/renderD129", 44, 0o660, false),
                ],
            ),
            &me,
            true,
        );
        assert!(s.contains("add group 44 and 110 to"), "{s}");
        // already in the group, but the mode gives the group no access: not a pod setting
        let s = said(
            DeviceKind::Hip,
            &amd(Some(f("/dev/kfd", 110, 0o600, false)), vec![render(true)]),
            &nonroot(&[110, 65532]),
            true,
        );
        assert!(s.contains("a node setting"), "{s}");
        // in the group, mode 0660, still refused (a read-only mount, an LSM): not fixed by adding the group
        let s = said(
            DeviceKind::Hip,
            &amd(Some(kfd(false)), vec![render(true)]),
            &nonroot(&[110, 65532]),
            true,
        );
        assert!(
            s.contains("a node setting") && !s.contains("add group"),
            "{s}"
        );
        // not in the group, but the group has no access either (mode 0606): adding it would not help
        let s = said(
            DeviceKind::Hip,
            &amd(Some(f("/dev/kfd", 110, 0o606, false)), vec![render(true)]),
            &me,
            true,
        );
        assert!(
            s.contains("a node setting") && !s.contains("add group"),
            "{s}"
        );
        // everything usable: the files explain nothing
        assert_eq!(
            hint(
                DeviceKind::Hip,
                &amd(Some(kfd(true)), vec![render(true)]),
                &nonroot(&[110, 65532]),
                true
            ),
            None
        );
    }

    #[test]
    fn observe_reads_the_vendor_s_files_and_their_groups() -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let d = tempfile::tempdir()?;
        std::fs::create_dir(d.path().join("dri"))?;
        for p in [
            "kfd",
            "dri/renderD129",
            "dri/renderD128",
            "dri/card0",
            "nvidiactl",
            "nvidia1",
            "nvidia0",
            "nvidia-uvm",
        ] {
            std::fs::write(d.path().join(p), b"")?;
            std::fs::set_permissions(d.path().join(p), std::fs::Permissions::from_mode(0o660))?;
        }
        let names = |s: &Seen| -> Vec<String> {
            s.control
                .iter()
                .chain(&s.devices)
                .map(|f| f.path.rsplit('/').next().unwrap_or_default().to_string())
                .collect()
        };
        let amd = observe(DeviceKind::Hip, d.path());
        assert_eq!(names(&amd), ["kfd", "renderD128", "renderD129"]);
        let kfd = amd.control.as_ref().map(|f| (f.mode, f.gid, f.usable));
        let gid = std::fs::metadata(d.path().join("kfd"))?.gid();
        assert_eq!(kfd, Some((0o660, gid, true)));
        // a file nobody may open: usable only for root, which access(2) lets through
        std::fs::set_permissions(d.path().join("kfd"), std::fs::Permissions::from_mode(0o000))?;
        let usable = observe(DeviceKind::Hip, d.path()).control.map(|f| f.usable);
        assert_eq!(usable, Some(identity().uid == 0));
        assert_eq!(
            names(&observe(DeviceKind::Cuda, d.path())),
            ["nvidiactl", "nvidia0", "nvidia1"]
        );
        let empty = observe(DeviceKind::Hip, &d.path().join("missing"));
        assert!(empty.control.is_none() && empty.devices.is_empty());
        Ok(())
    }
}
