//! JSON text written straight into a byte buffer, for the two documents on the admission
//! path: the patch and the response review. Building them as `serde_json::Value` trees first
//! cost more than the engine's decision; writing them field by field costs a few
//! instructions per byte.

use serde_json::Value;

/// Whether byte `b` must be escaped inside a JSON string (RFC 8259, section 7).
#[inline]
fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// The offset of the first byte in `bytes` that JSON escapes (see [`needs_escape`]), or
/// `bytes.len()` when there is none. Eight bytes at a time: reading a review and writing the
/// answer both spend most of their time inside strings.
pub(crate) fn first_needing_escape(bytes: &[u8]) -> usize {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES * 0x80;
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for word in &mut words {
        let word = u64::from_le_bytes(<[u8; 8]>::try_from(word).unwrap_or_default());
        let quote = word ^ (ONES * u64::from(b'"'));
        let backslash = word ^ (ONES * u64::from(b'\\'));
        // The high bit of each byte that is zero, or below 0x20. A borrow can mark a byte
        // above a marked one, never below it, so the lowest mark is exact.
        let marks = ((quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (word.wrapping_sub(ONES * 0x20) & !word))
            & HIGH;
        if marks != 0 {
            return at + (marks.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    let rest = words.remainder();
    at + rest
        .iter()
        .position(|&b| needs_escape(b))
        .unwrap_or(rest.len())
}

/// Appends `s` as the inside of a JSON string (no quotes), escaped as serde_json escapes.
pub(crate) fn str_contents(out: &mut Vec<u8>, s: &str) {
    let mut rest = s.as_bytes();
    loop {
        let at = first_needing_escape(rest);
        let (clean, tail) = rest.split_at(at);
        out.extend_from_slice(clean);
        let Some((&b, after)) = tail.split_first() else {
            return;
        };
        escape(out, b);
        rest = after;
    }
}

fn escape(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match b {
        b'"' => out.extend_from_slice(b"\\\""),
        b'\\' => out.extend_from_slice(b"\\\\"),
        b'\n' => out.extend_from_slice(b"\\n"),
        b'\r' => out.extend_from_slice(b"\\r"),
        b'\t' => out.extend_from_slice(b"\\t"),
        0x08 => out.extend_from_slice(b"\\b"),
        0x0c => out.extend_from_slice(b"\\f"),
        _ => out.extend_from_slice(&[
            b'\\',
            b'u',
            b'0',
            b'0',
            HEX[usize::from(b >> 4)],
            HEX[usize::from(b & 15)],
        ]),
    }
}

/// Appends `s` as a JSON string.
pub(crate) fn string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    str_contents(out, s);
    out.push(b'"');
}

/// Appends the concatenation of `parts` as one JSON string.
pub(crate) fn string_of_parts(out: &mut Vec<u8>, parts: &[&str]) {
    out.push(b'"');
    for part in parts {
        str_contents(out, part);
    }
    out.push(b'"');
}

/// Appends a JSON array, each item written by `write`.
pub(crate) fn array<T>(
    out: &mut Vec<u8>,
    items: impl IntoIterator<Item = T>,
    mut write: impl FnMut(&mut Vec<u8>, T),
) {
    out.push(b'[');
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(out, item);
    }
    out.push(b']');
}

/// Appends a JSON array of strings.
pub(crate) fn string_array<'s>(out: &mut Vec<u8>, items: impl IntoIterator<Item = &'s str>) {
    array(out, items, string);
}

/// Appends a JSON object of string values, keys in the order given.
pub(crate) fn string_object<'s>(
    out: &mut Vec<u8>,
    pairs: impl IntoIterator<Item = (&'s str, &'s str)>,
) {
    out.push(b'{');
    for (i, (key, value)) in pairs.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        string(out, key);
        out.push(b':');
        string(out, value);
    }
    out.push(b'}');
}

/// Appends a non-negative integer in decimal.
pub(crate) fn number(out: &mut Vec<u8>, n: impl Into<u64>) {
    out.extend_from_slice(decimal(n.into(), &mut [0; 20]));
}

/// `n` in decimal, written at the end of `digits`.
pub(crate) fn decimal(mut n: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &digits[start..]
}

/// Appends a JSON value taken from the input as it is.
pub(crate) fn value(out: &mut Vec<u8>, v: &Value) {
    let mark = out.len();
    // A Value's keys are strings and a Vec does not fail, so this cannot fail; should it
    // ever, the half-written text goes and `null` stands in, keeping the document valid.
    if serde_json::to_writer(&mut *out, v).is_err() {
        out.truncate(mark);
        out.extend_from_slice(b"null");
    }
}

/// Appends `input` in standard base64 with padding (RFC 4648), as a review's `patch` is
/// encoded. The alphabet needs no JSON escaping. The encoder picks the widest vector
/// instructions the CPU has at run time (AVX2, SSSE3, NEON), else a portable loop: for a
/// 1.2 KB patch, about 100 ns against 360 ns for a 12-bit table.
pub(crate) fn base64(out: &mut Vec<u8>, input: &[u8]) {
    base64_simd::STANDARD.encode_append(input, out);
}

/// Decodes standard base64, bit by bit: slow and plainly right, for checking [`base64`] and
/// the patches in answers. Panics on a character outside the alphabet.
#[cfg(test)]
pub(crate) fn decode_base64(text: &[u8]) -> Vec<u8> {
    // The alphabet of RFC 4648, section 4.
    const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = Vec::new();
    for &c in text.iter().filter(|&&c| c != b'=') {
        let v = BASE64
            .iter()
            .position(|&t| t == c)
            .expect("a base64 character");
        bits.extend((0..6).rev().map(|i| (v >> i) & 1));
    }
    bits.chunks_exact(8)
        .map(|b| b.iter().fold(0u8, |acc, &bit| (acc << 1) | bit as u8))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(s: &str) -> String {
        let mut out = Vec::new();
        string(&mut out, s);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn the_first_byte_needing_escape_is_found_at_every_offset() {
        // Each special byte, and bytes either side of the ranges, at every offset of two
        // words, after plain ASCII or non-ASCII text, followed by another special byte.
        let specials = [b'"', b'\\', 0x00, 0x1f, b'\n'];
        let plain = [
            b' ', b'!', b'#', b'[', b']', 0x7f, 0x80, 0x9f, 0xa0, 0xdc, 0xff,
        ];
        for &special in &specials {
            for &filler in &plain {
                for len in 0..20 {
                    for at in 0..=len {
                        let mut bytes = vec![filler; len];
                        if at < len {
                            bytes[at] = special;
                            if at + 1 < len {
                                bytes[at + 1] = b'"';
                            }
                        }
                        assert_eq!(first_needing_escape(&bytes), at, "{bytes:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        let mut cases: Vec<String> = vec![
            String::new(),
            "plain".into(),
            "quote \" backslash \\ slash /".into(),
            "tab\tnewline\nreturn\r\u{8}\u{c}\u{0}\u{1f}\u{7f}".into(),
            "é ü 日本 🚀".into(),
            "gpuwarden.io/rewritten".into(),
        ];
        // Every byte that needs escaping, at every offset across a block boundary.
        for b in (0u8..0x20).chain([b'"', b'\\']) {
            for at in 0..40 {
                let mut s = "x".repeat(40);
                s.replace_range(at..=at, &char::from(b).to_string());
                cases.push(s);
            }
        }
        // Bytes next to the ones that need escaping, and non-ASCII text, at every offset of
        // an eight-byte word; words with several escapes.
        for c in ['\u{20}', '!', '#', '[', ']', '\u{7f}', 'é', '日', '🚀'] {
            for at in 0..17 {
                cases.push(format!("{}{c}{}\"", "y".repeat(at), "z".repeat(17 - at)));
            }
        }
        cases.push("\"".repeat(19));
        cases.push("a\\b\u{1}c\"d\ne\"\"\\\\".repeat(3));
        for s in &cases {
            assert_eq!(written(s), serde_json::to_string(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn arrays_and_objects_parse_back() {
        let mut out = Vec::new();
        string_array(&mut out, ["a", "b\"c"]);
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap(),
            serde_json::json!(["a", "b\"c"])
        );
        out.clear();
        string_object(&mut out, [("k/1", "v\n"), ("k2", "")]);
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap(),
            serde_json::json!({"k/1": "v\n", "k2": ""})
        );
        out.clear();
        string_array(&mut out, []);
        assert_eq!(out, b"[]");
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        for n in [0, 7, 10, 403, 65_535, u64::MAX] {
            let mut out = Vec::new();
            number(&mut out, n);
            assert_eq!(out, n.to_string().as_bytes());
        }
    }

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            let mut out = b"prefix:".to_vec();
            base64(&mut out, input.as_bytes());
            assert_eq!(out, format!("prefix:{expected}").as_bytes());
        }
    }

    #[test]
    fn base64_round_trips_every_length_and_byte() {
        for len in 0usize..70 {
            let input: Vec<u8> = (0..len).map(|i| (i * 37 + len * 11) as u8).collect();
            let mut out = Vec::new();
            base64(&mut out, &input);
            assert_eq!(out.len(), len.div_ceil(3) * 4);
            assert_eq!(decode_base64(&out), input, "length {len}");
        }
    }
}
