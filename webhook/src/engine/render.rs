//! Writing what a plan does, in the three forms the answer carries: a warning per container
//! (kubectl prints them) and one summary line (the `changes` audit annotation), both from
//! the same phrases, and the `gpuwarden.io/rewritten` report, which says the same as JSON.

use super::plan::{ContainerPlan, CountFrom, EnvValue, Plan};
use super::{ContainerKind, MAX_WARNING_LEN};
use crate::json_out;

/// A [`Lit`] from a byte string literal, its escaped form worked out at compile time.
macro_rules! lit {
    ($text:literal) => {{
        const PLAIN: &[u8] = $text;
        const QUOTED: [u8; quoted_len(PLAIN)] = quoted(PLAIN);
        const LIT: Lit = Lit {
            plain: PLAIN,
            quoted: &QUOTED,
        };
        &LIT
    }};
}

/// Phrases written one after another with a separator.
struct Phrases<'o> {
    out: &'o mut String,
    separator: &'static str,
    empty: bool,
}

impl<'o> Phrases<'o> {
    fn new(out: &'o mut String, separator: &'static str) -> Self {
        Self {
            out,
            separator,
            empty: true,
        }
    }

    /// The buffer, ready for the next phrase.
    fn next(&mut self) -> &mut String {
        if !self.empty {
            self.out.push_str(self.separator);
        }
        self.empty = false;
        self.out
    }
}

/// A phrase naming a list, unless it is empty: `<before>a,b<after>`.
fn list_phrase<S: AsRef<str>>(phrases: &mut Phrases<'_>, before: &str, items: &[S], after: &str) {
    if items.is_empty() {
        return;
    }
    let out = phrases.next();
    out.push_str(before);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item.as_ref());
    }
    out.push_str(after);
}

/// `container trainer`, `init container setup`.
fn push_label(out: &mut String, kind: ContainerKind, name: &str) {
    out.push_str(kind.noun());
    out.push(' ');
    out.push_str(name);
}

impl Plan<'_> {
    /// The value a container's environment variable is set to.
    pub(super) fn env_value<'s>(&'s self, value: &EnvValue<'s>) -> &'s str {
        match value {
            EnvValue::DriverCapabilities => &self.driver_capabilities,
            EnvValue::Fixed(value) => value,
        }
    }

    /// The short phrases that say what the rewrite does to one container: `privileged
    /// removed`, `requests nvidia.com/gpu=1 (...)`, `env ... removed`, ...
    fn write_phrases(&self, phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>) {
        if c.deprivileged {
            phrases.next().push_str("privileged removed");
        }
        list_phrase(
            phrases,
            "capabilities ",
            &c.caps_refused,
            " dropped (not allowed)",
        );
        if let Some(limit) = &c.limit {
            let out = phrases.next();
            let from_request = matches!(limit.from, CountFrom::Request);
            out.push_str(if from_request { "limits " } else { "requests " });
            out.push_str(limit.resource);
            out.push('=');
            limit.quantity.with_text(|text| out.push_str(text));
            if from_request {
                out.push_str(" (from its request)");
            } else {
                out.push_str(" (");
                limit
                    .from
                    .parts()
                    .iter()
                    .for_each(|part| out.push_str(part));
                out.push(')');
            }
        }
        if let Some(env) = &c.env {
            list_phrase(phrases, "env ", &env.removed, " removed");
            if let Some((name, value)) = &env.set {
                let out = phrases.next();
                out.push_str(name);
                out.push('=');
                out.push_str(self.env_value(value));
            }
        }
        if !c.mounts_removed.is_empty() {
            let out = phrases.next();
            out.push_str("device mount ");
            for (i, name) in c.mounts_removed.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(name);
                if let Some(path) = self.device_volumes.path(name) {
                    out.push_str(" (");
                    out.push_str(path);
                    out.push(')');
                }
            }
            out.push_str(" removed");
        }
    }

    /// The pod-level phrases: device hostPath volumes and annotations removed.
    fn write_pod_phrases(&self, phrases: &mut Phrases<'_>) {
        list_phrase(
            phrases,
            "device hostPath volume ",
            &self.volumes_removed,
            " removed",
        );
        list_phrase(
            phrases,
            "annotation ",
            &self.annotations_removed,
            " removed",
        );
    }

    /// Whether the rewrite touches the pod itself (volumes or annotations).
    fn touches_pod(&self) -> bool {
        !self.volumes_removed.is_empty() || !self.annotations_removed.is_empty()
    }

    /// One warning per touched container, then one for the pod: `<prefix><label><middle>`
    /// and the phrases joined by `; `, each clipped. `scratch` holds each in turn.
    pub(super) fn for_each_warning(
        &self,
        prefix: &str,
        middle: &str,
        scratch: &mut String,
        f: &mut dyn FnMut(&str),
    ) {
        for c in &self.containers {
            scratch.clear();
            scratch.push_str(prefix);
            push_label(scratch, c.at.kind, c.name);
            scratch.push_str(middle);
            self.write_phrases(&mut Phrases::new(scratch, "; "), c);
            f(clip(scratch));
        }
        if self.touches_pod() {
            scratch.clear();
            scratch.push_str(prefix);
            scratch.push_str("pod");
            scratch.push_str(middle);
            self.write_pod_phrases(&mut Phrases::new(scratch, "; "));
            f(clip(scratch));
        }
    }

    /// One line for the audit log: `container train: privileged removed, ...; pod: ...`.
    pub(super) fn write_summary(&self, line: &mut String) {
        for (i, c) in self.containers.iter().enumerate() {
            if i > 0 {
                line.push_str("; ");
            }
            push_label(line, c.at.kind, c.name);
            line.push_str(": ");
            self.write_phrases(&mut Phrases::new(line, ", "), c);
        }
        if self.touches_pod() {
            if !self.containers.is_empty() {
                line.push_str("; ");
            }
            line.push_str("pod: ");
            self.write_pod_phrases(&mut Phrases::new(line, ", "));
        }
    }

    /// Writes the `gpuwarden.io/rewritten` (or `gpuwarden.io/audit`) annotation value: per
    /// container name, sorted by name, what changed (the last of a repeated name wins, as in
    /// an object); the pod's volumes and annotations removed; and why Enforce would deny the
    /// pod (Audit only).
    pub(super) fn write_report(&self, out: &mut impl ReportOut) {
        out.lit(lit!(b"{\"containers\":{"));
        let (single, sorted);
        let order: &[&ContainerPlan<'_>] = match self.containers.as_slice() {
            [] => &[],
            [only] => {
                single = [only];
                &single
            }
            _ => {
                // Stable: of containers sharing a name (a malformed pod), the last stays last.
                let mut order: Vec<&ContainerPlan<'_>> = self.containers.iter().collect();
                order.sort_by(|a, b| a.name.cmp(b.name));
                sorted = order;
                &sorted
            }
        };
        let mut first = true;
        for (i, c) in order.iter().enumerate() {
            if order.get(i + 1).is_some_and(|next| next.name == c.name) {
                continue;
            }
            if !first {
                out.lit(lit!(b","));
            }
            first = false;
            out.string(&[c.name]);
            out.lit(lit!(b":"));
            self.write_container_report(out, c);
        }
        out.lit(lit!(b"}"));
        list_field(out, lit!(b",\"volumesRemoved\":"), &self.volumes_removed);
        list_field(
            out,
            lit!(b",\"annotationsRemoved\":"),
            &self.annotations_removed,
        );
        list_field(out, lit!(b",\"denials\":"), &self.denials);
        out.lit(lit!(b"}"));
    }

    fn write_container_report(&self, out: &mut impl ReportOut, c: &ContainerPlan<'_>) {
        out.lit(match c.at.kind {
            ContainerKind::Init => lit!(b"{\"kind\":\"init\",\"privileged\":false"),
            ContainerKind::Ephemeral => lit!(b"{\"kind\":\"ephemeral\",\"privileged\":false"),
            // The container lost privilege, or never had it.
            ContainerKind::Regular => lit!(b"{\"privileged\":false"),
        });
        out.lit(if c.gpu {
            lit!(b",\"gpu\":true")
        } else {
            lit!(b",\"gpu\":false")
        });
        list_field(out, lit!(b",\"capabilitiesAdded\":"), &c.caps_added);
        if c.drop_all {
            out.lit(lit!(b",\"capabilitiesDropped\":[\"ALL\"]"));
        }
        list_field(out, lit!(b",\"capabilitiesRefused\":"), &c.caps_refused);
        if let Some(limit) = &c.limit {
            out.lit(lit!(b",\"limits\":{"));
            out.string(&[limit.resource]);
            out.lit(lit!(b":"));
            limit.quantity.with_text(|text| out.string(&[text]));
            out.lit(lit!(b"},\"gpuCountFrom\":"));
            out.string(&limit.from.parts());
        }
        if let Some(env) = &c.env {
            list_field(out, lit!(b",\"envRemoved\":"), &env.removed);
            if let Some((name, value)) = &env.set {
                out.lit(lit!(b",\"envSet\":{"));
                out.string(&[name]);
                out.lit(lit!(b":"));
                out.string(&[self.env_value(value)]);
                out.lit(lit!(b"}"));
            }
        }
        list_field(out, lit!(b",\"volumeMountsRemoved\":"), &c.mounts_removed);
        out.lit(lit!(b"}"));
    }

    /// The report as JSON text.
    pub(super) fn report(&self) -> String {
        let mut out = Plain(Vec::with_capacity(512));
        self.write_report(&mut out);
        // Only whole strings and ASCII punctuation were written.
        String::from_utf8(out.0).unwrap_or_default()
    }

    /// Whether `text` is the report, written byte for byte.
    pub(super) fn report_is(&self, text: &str) -> bool {
        self.report() == text
    }
}

/// `<key>[...]` unless `items` is empty; `key` holds the comma and colon around it.
fn list_field<S: AsRef<str>>(out: &mut impl ReportOut, key: &Lit, items: &[S]) {
    if items.is_empty() {
        return;
    }
    out.lit(key);
    out.lit(lit!(b"["));
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.lit(lit!(b","));
        }
        out.string(&[item.as_ref()]);
    }
    out.lit(lit!(b"]"));
}

/// A piece of the report's JSON punctuation and key names, as it is and as it reads inside
/// a JSON string (each `"` and `\` escaped), both worked out when the program is compiled.
pub(super) struct Lit {
    plain: &'static [u8],
    quoted: &'static [u8],
}

/// How long `text` is once each `"` and `\` in it is escaped.
pub(super) const fn quoted_len(text: &[u8]) -> usize {
    let mut len = text.len();
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'"' || text[i] == b'\\' {
            len += 1;
        }
        i += 1;
    }
    len
}

/// `text` with each `"` and `\` escaped, in `N` ([`quoted_len`]) bytes.
pub(super) const fn quoted<const N: usize>(text: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    let (mut i, mut j) = (0, 0);
    while i < text.len() {
        if text[i] == b'"' || text[i] == b'\\' {
            out[j] = b'\\';
            j += 1;
        }
        out[j] = text[i];
        j += 1;
        i += 1;
    }
    out
}

/// Where the report goes: a JSON document ([`Plain`]), or the contents of the JSON string
/// that carries it in the patch ([`Quoted`]), so that it is not written once and escaped
/// again.
pub(super) trait ReportOut {
    /// Punctuation and key names.
    fn lit(&mut self, lit: &Lit);
    /// A JSON string whose text is the concatenation of `parts`.
    fn string(&mut self, parts: &[&str]);
}

/// The report as a JSON document.
pub(super) struct Plain(pub(super) Vec<u8>);

impl ReportOut for Plain {
    fn lit(&mut self, lit: &Lit) {
        self.0.extend_from_slice(lit.plain);
    }

    fn string(&mut self, parts: &[&str]) {
        json_out::string_of_parts(&mut self.0, parts);
    }
}

/// The report escaped as the contents of a JSON string, appended to a buffer.
pub(super) struct Quoted<'o>(pub(super) &'o mut Vec<u8>);

impl ReportOut for Quoted<'_> {
    fn lit(&mut self, lit: &Lit) {
        self.0.extend_from_slice(lit.quoted);
    }

    fn string(&mut self, parts: &[&str]) {
        let plain = parts
            .iter()
            .all(|part| json_out::first_needing_escape(part.as_bytes()) == part.len());
        if plain {
            // Escaping text that needs none leaves it as it is, twice over.
            self.0.extend_from_slice(b"\\\"");
            parts
                .iter()
                .for_each(|part| self.0.extend_from_slice(part.as_bytes()));
            self.0.extend_from_slice(b"\\\"");
        } else {
            let mut once = Vec::new();
            json_out::string_of_parts(&mut once, parts);
            // Only whole strings were written.
            json_out::str_contents(self.0, std::str::from_utf8(&once).unwrap_or_default());
        }
    }
}

/// Bytes of text buffer a thread keeps between reviews.
const SCRATCH_KEPT_BYTES: usize = 4096;

thread_local! {
    /// The text buffer warnings and the summary line are written in, kept for the next
    /// review on the same thread.
    static SCRATCH: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
}

/// Runs `f` with the thread's text buffer, empty. A call from inside `f` gets a buffer of
/// its own; a buffer an unusual pod grew past [`SCRATCH_KEPT_BYTES`] is given back.
pub(super) fn with_scratch<R>(f: impl FnOnce(&mut String) -> R) -> R {
    let mut text = SCRATCH.take();
    text.clear();
    let result = f(&mut text);
    if text.capacity() <= SCRATCH_KEPT_BYTES {
        SCRATCH.set(text);
    }
    result
}

/// The text cut to [`MAX_WARNING_LEN`] bytes on a character boundary, with `...`.
pub(super) fn clip(text: &mut String) -> &str {
    if text.len() > MAX_WARNING_LEN {
        let mut end = MAX_WARNING_LEN - 3;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_buffer_starts_empty_and_is_not_shared_by_nested_calls() {
        with_scratch(|outer| {
            outer.push_str("outer");
            with_scratch(|inner| {
                assert!(inner.is_empty());
                inner.push_str("inner");
            });
            assert_eq!(outer, "outer");
        });
        with_scratch(|text| assert!(text.is_empty(), "{text:?}"));
        // A buffer grown past what is kept is given back, not kept.
        with_scratch(|text| text.push_str(&"x".repeat(2 * SCRATCH_KEPT_BYTES)));
        with_scratch(|text| assert!(text.capacity() <= SCRATCH_KEPT_BYTES));
    }
}
