//! Globs as gpuwarden's API writes them (image, resource and runtime-class patterns): `*`
//! any run of characters, `?` one, everything else literal. The CEL that follows them is
//! `admission::cel::glob_regex`.

/// Matches `text` against a glob with `*` (any run of characters) and `?` (one character).
/// Every other character is literal. Image references are ASCII, so this works on bytes.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    glob_bytes(pattern.as_bytes(), text.as_bytes(), b"")
}

/// [`glob_match`] against the concatenation `head` + `tail`, without building it.
pub(crate) fn glob_bytes(p: &[u8], head: &[u8], tail: &[u8]) -> bool {
    let len = head.len() + tail.len();
    let at = |i: usize| {
        if i < head.len() {
            head[i]
        } else {
            tail[i - head.len()]
        }
    };
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < len {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == at(ti)) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == b'*' {
        pi += 1;
    }
    pi == p.len()
}
