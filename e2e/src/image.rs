//! An OCI image layout, written without a registry or a container builder, for the
//! in-cluster test: the workspace's binaries, the shared libraries they load (as `ldd`
//! finds them on this machine), and the `/etc/passwd` and `/etc/group` entries of
//! distroless's `nonroot` user, in one uncompressed layer. `tar`, `sha256sum` and `ldd` do
//! the byte work; the layout's JSON is written here.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

/// Errors building the image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file could not be read or written.
    #[error("failed to {what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A tool (`tar`, `sha256sum`, `ldd`) failed or could not be started.
    #[error("failed to run {command}: {message}")]
    Tool {
        /// The command line.
        command: String,
        /// Its standard error, or why it did not start.
        message: String,
    },
}

/// distroless's users, as its `/etc/passwd` lists them.
const PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";

/// distroless's groups.
const GROUP: &str = "root:x:0:\nnobody:x:65534:\ntty:x:5:\nstaff:x:50:\nnonroot:x:65532:\n";

/// The image's one user, numeric so that `runAsNonRoot` can verify it (as in the Dockerfile).
pub const IMAGE_USER: &str = "65532:65532";

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ImageError {
    let path = path.display().to_string();
    move |source| ImageError::Io { what, path, source }
}

fn run(command: &mut Command) -> Result<String, ImageError> {
    let line = format!("{command:?}");
    let output = command.output().map_err(|e| ImageError::Tool {
        command: line.clone(),
        message: e.to_string(),
    })?;
    if !output.status.success() {
        return Err(ImageError::Tool {
            command: line,
            message: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The shared libraries `binary` loads, with the dynamic loader: absolute paths, as `ldd`
/// prints them (`libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6`, `/lib64/ld-linux-x86-64.so.2`).
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let out = run(Command::new("ldd").arg(binary))?;
    let mut libs: Vec<PathBuf> = out
        .lines()
        .filter_map(|line| {
            let target = match line.split_once("=>") {
                Some((_, rest)) => rest,
                None => line,
            };
            let path = target.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect();
    libs.sort();
    libs.dedup();
    Ok(libs)
}

/// `sha256:<hex>` of a file.
fn digest(path: &Path) -> Result<String, ImageError> {
    let out = run(Command::new("sha256sum").arg(path))?;
    let hex = out.split_whitespace().next().unwrap_or_default();
    Ok(format!("sha256:{hex}"))
}

/// Moves `path` into `layout/blobs/sha256/` under its digest; returns the digest and size.
fn blob(layout: &Path, path: &Path) -> Result<(String, u64), ImageError> {
    let digest = digest(path)?;
    let size = std::fs::metadata(path).map_err(io("read", path))?.len();
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    let target = dir.join(digest.trim_start_matches("sha256:"));
    std::fs::rename(path, &target).map_err(io("move", path))?;
    Ok((digest, size))
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io("create", parent))?;
    }
    std::fs::write(path, bytes).map_err(io("write", path))
}

/// A tar of `entries` under `dir` at `out`: owned by root, dated at the epoch, in name order,
/// so the same inputs give the same bytes (and digest).
fn tar(dir: &Path, out: &Path, entries: &[&str]) -> Result<String, ImageError> {
    run(Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
        ])
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg(out)
        .args(entries))
}

/// Copies `from` (following links) to `root` + `to`, with `mode`.
fn install(root: &Path, from: &Path, to: &Path, mode: u32) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    let target = root.join(to.strip_prefix("/").unwrap_or(to));
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(io("create", parent))?;
    }
    std::fs::copy(from, &target).map_err(io("copy", from))?;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
        .map_err(io("chmod", &target))
}

/// Writes an OCI image layout tar at `out`, named `name` (`io.containerd.image.name`, what
/// `ctr images import` tags it as), whose one layer holds `binaries` in `/usr/local/bin`,
/// the shared libraries they load at the paths `ldd` finds them, and distroless's
/// `/etc/passwd` and `/etc/group`; it runs as [`IMAGE_USER`]. `work` is a scratch
/// directory. Returns the manifest's digest.
pub fn write_oci_layout(
    work: &Path,
    out: &Path,
    name: &str,
    binaries: &[PathBuf],
) -> Result<String, ImageError> {
    let root = work.join("rootfs");
    let mut libs = Vec::new();
    for binary in binaries {
        let file = binary.file_name().unwrap_or_default();
        install(
            &root,
            binary,
            &Path::new("/usr/local/bin").join(file),
            0o755,
        )?;
        libs.extend(shared_libraries(binary)?);
    }
    libs.sort();
    libs.dedup();
    for lib in &libs {
        install(&root, lib, lib, 0o755)?;
    }
    write(&root.join("etc/passwd"), PASSWD.as_bytes())?;
    write(&root.join("etc/group"), GROUP.as_bytes())?;
    for dir in ["tmp", "home/nonroot"] {
        let path = root.join(dir);
        std::fs::create_dir_all(&path).map_err(io("create", &path))?;
    }

    write_rootfs_layout(work, &root, out, name, Some(IMAGE_USER))
}

/// Writes an OCI image layout tar at `out`, named `name`, whose one layer is the directory
/// `root` as it is (owners and modes kept, as `tar` archives them), run as `user` (the
/// image's default, root, when `None`). `work` is a scratch directory. Returns the
/// manifest's digest.
pub fn write_rootfs_layout(
    work: &Path,
    root: &Path,
    out: &Path,
    name: &str,
    user: Option<&str>,
) -> Result<String, ImageError> {
    let layer = work.join("layer.tar");
    tar(root, &layer, &["."])?;
    let layout = work.join("layout");
    let (layer_digest, layer_size) = blob(&layout, &layer)?;

    let mut config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "gpuwarden-e2e write_rootfs_layout"}],
    });
    if let Some(user) = user {
        config["config"]["User"] = json!(user);
    }
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json"},
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer_size,
        }],
    });
    finish_layout(work, &layout, out, name, &config, manifest)
}

/// The OCI image manifest's media type.
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// Writes `config` and `manifest` (its config descriptor completed here) into `layout`,
/// whose blobs hold the manifest's layers, an index naming the image `name`, and the layout
/// as a tar at `out`. Returns the manifest's digest.
fn finish_layout(
    work: &Path,
    layout: &Path,
    out: &Path,
    name: &str,
    config: &Value,
    mut manifest: Value,
) -> Result<String, ImageError> {
    let config_file = work.join("config.json");
    write(&config_file, config.to_string().as_bytes())?;
    let (config_digest, config_size) = blob(layout, &config_file)?;
    manifest["config"]["digest"] = json!(config_digest);
    manifest["config"]["size"] = json!(config_size);
    let manifest_file = work.join("manifest.json");
    write(&manifest_file, manifest.to_string().as_bytes())?;
    let (manifest_digest, manifest_size) = blob(layout, &manifest_file)?;

    let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": manifest.get("mediaType").cloned().unwrap_or_else(|| json!(MANIFEST)),
            "digest": manifest_digest,
            "size": manifest_size,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    });
    write(&layout.join("index.json"), index.to_string().as_bytes())?;
    write(
        &layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    tar(layout, out, &["oci-layout", "index.json", "blobs"])?;
    Ok(manifest_digest)
}

/// Reads a JSON blob of an extracted layout.
fn read_blob(layout: &Path, digest: &str) -> Result<Value, ImageError> {
    let path = layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"));
    let text = std::fs::read(&path).map_err(io("read", &path))?;
    serde_json::from_slice(&text).map_err(|e| ImageError::Io {
        what: "parse",
        path: path.display().to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
}

/// Writes an OCI image layout tar at `out`, named `name`, of the image in `base` (an
/// archive `ctr images export` wrote, for linux/amd64) with `env` (`NAME=value`) set in its
/// config, replacing the base's values of those names: what a CUDA base image's
/// `ENV NVIDIA_VISIBLE_DEVICES=all` does, around any small image. Its layers are the
/// base's. `work` is a scratch directory. Returns the manifest's digest.
pub fn derive_with_env(
    work: &Path,
    base: &Path,
    out: &Path,
    name: &str,
    env: &[&str],
) -> Result<String, ImageError> {
    let extracted = work.join("base");
    std::fs::create_dir_all(&extracted).map_err(io("create", &extracted))?;
    run(Command::new("tar")
        .arg("-xf")
        .arg(base)
        .arg("-C")
        .arg(&extracted))?;
    let index_path = extracted.join("index.json");
    let index = std::fs::read(&index_path).map_err(io("read", &index_path))?;
    let mut node: Value = serde_json::from_slice(&index).map_err(|e| ImageError::Io {
        what: "parse",
        path: index_path.display().to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })?;
    // Down the index (and any nested one, for a multi-platform image) to linux/amd64.
    let manifest = loop {
        let entries = node["manifests"].as_array().cloned().unwrap_or_default();
        let entry = (entries.iter())
            .find(|m| m["platform"]["architecture"] == "amd64")
            .or(entries.first())
            .ok_or_else(|| ImageError::Tool {
                command: format!("read {}", base.display()),
                message: "the archive's index lists no manifest".into(),
            })?;
        let digest = entry["digest"].as_str().unwrap_or_default();
        let next = read_blob(&extracted, digest)?;
        if next.get("manifests").is_some() {
            node = next;
        } else {
            break next;
        }
    };
    let mut config = read_blob(
        &extracted,
        manifest["config"]["digest"].as_str().unwrap_or(""),
    )?;
    let names: Vec<&str> = env
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(n, _)| n)
        .collect();
    let mut vars: Vec<Value> = (config["config"]["Env"].as_array().into_iter().flatten())
        .filter(|v| {
            let name = v.as_str().and_then(|v| v.split_once('=')).map(|(n, _)| n);
            !name.is_some_and(|n| names.contains(&n))
        })
        .cloned()
        .collect();
    vars.extend(env.iter().map(|e| json!(e)));
    config["config"]["Env"] = Value::Array(vars);

    let layout = work.join("layout");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(io("create", &blobs))?;
    for layer in manifest["layers"].as_array().into_iter().flatten() {
        let hex = layer["digest"]
            .as_str()
            .unwrap_or("")
            .trim_start_matches("sha256:");
        let from = extracted.join("blobs/sha256").join(hex);
        std::fs::copy(&from, blobs.join(hex)).map_err(io("copy", &from))?;
    }
    finish_layout(work, &layout, out, name, &config, manifest)
}
