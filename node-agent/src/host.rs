//! Paths on the host, as the agent sees them under the host root.

use std::path::{Path, PathBuf};

/// `path`, a path on the host, under `host_root` (`/` on the host, `/host` in the pod).
pub(crate) fn under(host_root: &Path, path: &str) -> PathBuf {
    host_root.join(path.trim_start_matches('/'))
}
