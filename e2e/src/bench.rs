//! What the benchmarks against a real API server share: the number of rounds from the
//! command line, quantiles of sorted timings, and the exit code of a run.

use std::future::Future;
use std::process::ExitCode;

/// The rounds the command line asks for (its first number), else `default`.
pub fn rounds(default: usize) -> usize {
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default)
}

/// The `q` quantile of `sorted` timings (nearest rank); NaN for none.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = ((sorted.len().saturating_sub(1)) as f64 * q).round() as usize;
    sorted.get(at).copied().unwrap_or(f64::NAN)
}

/// Runs benchmark `name`: success, or its error on standard error and a failure.
pub async fn exit(name: &str, run: impl Future<Output = Result<(), String>>) -> ExitCode {
    match run.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
