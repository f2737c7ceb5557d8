//! What the cluster benchmarks read: their size from the environment, the operator process's
//! memory from `/proc`, and its counters from its `/metrics`. Included with
//! `#[path = "support/measure.rs"] mod measure;`.

/// `name` from the environment as a number, or `default`.
pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), 0 where it cannot be read.
pub fn vm_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// `kib` as MiB, for the report.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// Sum of the Prometheus counter `name` over its series whose line holds `filter`, in a
/// text exposition.
pub fn counter_sum(exposition: &str, name: &str, filter: &str) -> f64 {
    exposition
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(filter))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .fold(0.0, |sum, v| sum + v)
}

/// The operator's `/metrics` on `port`, or `None` where it does not answer.
pub async fn operator_metrics(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out).await;
    Some(out)
}

/// The operator's writes whose series holds `filter`, or `None` where it does not answer.
pub async fn operator_writes(port: u16, filter: &str) -> Option<f64> {
    let text = operator_metrics(port).await?;
    Some(counter_sum(
        &text,
        "gpuwarden_operator_writes_total",
        filter,
    ))
}
