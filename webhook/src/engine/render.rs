//! Writing what a plan does, in the three forms the answer carries: a warning per container
//! (kubectl prints them), one summary line (the `changes` audit annotation) and the
//! `gpuwarden.io/rewritten` report (JSON). All three are written from the same phrases.

use super::plan::{ContainerPlan, CountFrom, EnvValue, Plan};
use super::{ContainerKind, MAX_WARNING_LEN};
use crate::json_out;

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
            list_phrase(phrases, "env ", env.removed.as_slice(), " removed");
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

    /// The `gpuwarden.io/rewritten` (or `gpuwarden.io/audit`) annotation value: per
    /// container name, sorted by name, what changed (the last of a repeated name wins, as in
    /// an object); the pod's volumes and annotations removed; and why Enforce would deny the
    /// pod (Audit only).
    pub(super) fn report(&self) -> String {
        let mut out = Vec::with_capacity(512);
        out.extend_from_slice(b"{\"containers\":{");
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
                out.push(b',');
            }
            first = false;
            json_out::string(&mut out, c.name);
            out.push(b':');
            self.write_container_report(&mut out, c);
        }
        out.push(b'}');
        list_field(&mut out, "volumesRemoved", &self.volumes_removed);
        list_field(&mut out, "annotationsRemoved", &self.annotations_removed);
        list_field(&mut out, "denials", &self.denials);
        out.push(b'}');
        // Only whole strings and ASCII punctuation were written.
        String::from_utf8(out).unwrap_or_default()
    }

    fn write_container_report(&self, out: &mut Vec<u8>, c: &ContainerPlan<'_>) {
        out.push(b'{');
        match c.at.kind {
            ContainerKind::Init => out.extend_from_slice(b"\"kind\":\"init\","),
            ContainerKind::Ephemeral => out.extend_from_slice(b"\"kind\":\"ephemeral\","),
            ContainerKind::Regular => {}
        }
        // The container lost privilege, or never had it.
        out.extend_from_slice(b"\"privileged\":false");
        out.extend_from_slice(if c.gpu {
            b",\"gpu\":true"
        } else {
            b",\"gpu\":false"
        });
        list_field(out, "capabilitiesAdded", &c.caps_added);
        if c.drop_all {
            out.extend_from_slice(b",\"capabilitiesDropped\":[\"ALL\"]");
        }
        list_field(out, "capabilitiesRefused", &c.caps_refused);
        if let Some(limit) = &c.limit {
            out.extend_from_slice(b",\"limits\":{");
            json_out::string(out, limit.resource);
            out.push(b':');
            limit.quantity.with_text(|text| json_out::string(out, text));
            out.extend_from_slice(b"},\"gpuCountFrom\":");
            json_out::string_of_parts(out, &limit.from.parts());
        }
        if let Some(env) = &c.env {
            list_field(out, "envRemoved", env.removed.as_slice());
            if let Some((name, value)) = &env.set {
                out.extend_from_slice(b",\"envSet\":{");
                json_out::string(out, name);
                out.push(b':');
                json_out::string(out, self.env_value(value));
                out.push(b'}');
            }
        }
        list_field(out, "volumeMountsRemoved", &c.mounts_removed);
        out.push(b'}');
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

/// `,"<key>":[...]` unless `items` is empty (after the first field of an object).
fn list_field<S: AsRef<str>>(out: &mut Vec<u8>, key: &str, items: &[S]) {
    if items.is_empty() {
        return;
    }
    out.push(b',');
    json_out::string(out, key);
    out.push(b':');
    json_out::string_array(out, items.iter().map(AsRef::as_ref));
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
