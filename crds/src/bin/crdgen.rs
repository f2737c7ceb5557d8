//! Writes the generated files under `deploy/` (CRDs, default policy).
//!
//! `cargo run -p gpuwarden-crds --bin crdgen` from anywhere in the repository; `--check`
//! exits non-zero when a file is out of date instead of writing it.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crds crate lives in the workspace");
    let mut stale = false;
    for file in gpuwarden_crds::manifests::generated_files() {
        let path = root.join(file.path);
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref() == Some(file.content.as_str()) {
            continue;
        }
        if check {
            eprintln!("{} is out of date", file.path);
            stale = true;
            continue;
        }
        if let Some(dir) = path.parent()
            && let Err(e) = std::fs::create_dir_all(dir)
        {
            eprintln!("failed to create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
        if let Err(e) = std::fs::write(&path, &file.content) {
            eprintln!("failed to write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}", file.path);
    }
    if stale {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
