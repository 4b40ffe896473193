//! `crdgen [--check] [ROOT]`: write (or, with `--check`, compare) the generated CRD YAML under
//! `deploy/crds/` and `charts/flexinfer/files/crds/` (the chart templates them: templates/crds.yaml).

use std::path::PathBuf;
use std::process::ExitCode;

use flexinfer_api::crdgen::{crds, to_yaml, OUTPUT_DIRS};

fn main() -> ExitCode {
    let mut check = false;
    let mut root = PathBuf::from(".");
    for a in std::env::args().skip(1) {
        if a == "--check" {
            check = true;
        } else {
            root = PathBuf::from(a);
        }
    }
    let mut stale = Vec::new();
    for dir in OUTPUT_DIRS {
        let d = root.join(dir);
        if !check {
            if let Err(e) = std::fs::create_dir_all(&d) {
                eprintln!("crdgen: cannot create {}: {e}", d.display());
                return ExitCode::FAILURE;
            }
        }
        for (name, crd) in crds() {
            let yaml = match to_yaml(&crd) {
                Ok(y) => y,
                Err(e) => {
                    eprintln!("crdgen: cannot serialize {name}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let path = d.join(name);
            if check {
                if std::fs::read_to_string(&path).ok().as_deref() != Some(yaml.as_str()) {
                    stale.push(path.display().to_string());
                }
            } else if let Err(e) = std::fs::write(&path, yaml) {
                eprintln!("crdgen: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            } else {
                println!("wrote {}", path.display());
            }
        }
    }
    if !stale.is_empty() {
        eprintln!(
            "crdgen: generated CRDs differ from the checked-in YAML (run `make crds`): {}",
            stale.join(", ")
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
