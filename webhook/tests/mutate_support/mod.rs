//! Driving the offline `mutate` command through its library function, as its flags parse.

use clap::Parser;
use gpuwarden_webhook::mutate::{self, MutateArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: MutateArgs,
}

/// What `mutate` answered for one run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `mutate` with these flags and `stdin`.
pub fn run_with_stdin(args: &[&str], stdin: &str) -> Run {
    let cli = Cli::try_parse_from(std::iter::once("mutate").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("flags {args:?}: {e}"));
    let mut out = Vec::new();
    let mut err = Vec::new();
    let code = mutate::run(&cli.args, &mut stdin.as_bytes(), &mut out, &mut err);
    Run {
        code,
        stdout: String::from_utf8(out).unwrap(),
        stderr: String::from_utf8(err).unwrap(),
    }
}

/// Runs `mutate` with these flags and nothing on stdin.
pub fn run(args: &[&str]) -> Run {
    run_with_stdin(args, "")
}
