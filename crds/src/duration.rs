//! Go-style durations (`90s`, `10m`, `1h30m`) as Kubernetes users write them.

use std::time::Duration;

/// Regex the CRD schema uses for duration strings.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// A duration string that could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid duration {input:?}: {reason}")]
pub struct DurationError {
    input: String,
    reason: &'static str,
}

/// Parses a Go-style duration such as `10m`, `1h30m` or `1.5s`.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let err = |reason| DurationError {
        input: input.to_owned(),
        reason,
    };
    if input.is_empty() {
        return Err(err("empty"));
    }
    let mut total = 0f64;
    let mut rest = input;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| err("missing unit"))?;
        if num_len == 0 {
            return Err(err("expected a number"));
        }
        let value: f64 = rest[..num_len].parse().map_err(|_| err("bad number"))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(err("unknown unit (use ns, us, ms, s, m or h)")),
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    if !total.is_finite() || total > 10.0 * 365.0 * 86400.0 {
        return Err(err("too large"));
    }
    Ok(Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "10", "m", "10x", "1..5s", "-5s", "99999999999h"] {
            assert!(parse_duration(bad).is_err(), "{bad} should fail");
        }
    }
}
