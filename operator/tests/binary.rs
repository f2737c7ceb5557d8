//! `gpuwarden-operator run` as a user runs it out of cluster: the binary, a KUBECONFIG, and an
//! API server (here the fake one, over HTTP). It reconciles, serves /readyz, and exits 0 on
//! SIGTERM.

#[path = "support/fake_api.rs"]
mod fake_api;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake_api::{FakeApi, gpunode, lease, node};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn status_code(addr: std::net::SocketAddr, path: &str) -> u16 {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return 0;
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return 0;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_runs_with_a_kubeconfig_and_stops_on_sigterm() {
    let fake = Arc::new(FakeApi::default());
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    for i in 0..3 {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        fake.insert("leases", &format!("gpuwarden-agent-{name}"), lease(i, &now));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, fake_api::router(fake_server(&fake))).await;
    });

    let kubeconfig = std::env::temp_dir().join(format!(
        "gpuwarden-operator-test-{}.yaml",
        std::process::id()
    ));
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{api}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\n"
        ),
    )
    .unwrap();
    let health = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuwarden-operator"))
        .args(["run", "--leader-election=false", "--log-format", "text"])
        .arg(format!("--health-listen={health}"))
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("POD_NAMESPACE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(30);
    while !(status_code(health, "/readyz").await == 200
        && FAKE
            .get()
            .is_some_and(|f| f.status_writes.load(Ordering::Relaxed) >= 3))
    {
        assert!(
            Instant::now() < deadline,
            "operator never became ready and wrote statuses"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "operator did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = std::fs::remove_file(&kubeconfig);
    // Logs go to stdout (tracing's default); errors from main to stderr.
    let mut stderr = String::new();
    for out in [
        child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn std::io::Read>),
        child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn std::io::Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut out = out;
        let _ = out.read_to_string(&mut stderr);
    }
    assert!(status.success(), "exit {status:?}; logs:\n{stderr}");
    assert!(stderr.contains("caches synced"), "{stderr}");
    assert!(
        !stderr.contains('\x1b'),
        "text logs into a pipe carry terminal colour codes: {stderr:?}"
    );
    assert!(stderr.contains("stopped"), "{stderr}");
}

static FAKE: std::sync::OnceLock<Arc<FakeApi>> = std::sync::OnceLock::new();

/// Keeps a handle to the fake for the assertions above.
fn fake_server(fake: &Arc<FakeApi>) -> Arc<FakeApi> {
    let _ = FAKE.set(fake.clone());
    fake.clone()
}
