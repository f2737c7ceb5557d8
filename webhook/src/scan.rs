//! A one-pass reader of AdmissionReview bodies, tried before serde.
//!
//! It reads what [`crate::admission`]'s serde view reads, into the same types, walking the
//! text once without serde's generic machinery: a field the engine does not read is skipped
//! with a small loop, a string without escapes is borrowed as it stands.
//!
//! It takes only input whose reading it is sure of. Where the serde view would refuse the
//! body, or where matching it would take more code than the case is worth, it gives up and
//! the caller reads the body with serde as before:
//! - anything that is not JSON, a top-level value that is not an object, text after it;
//! - a field of a known struct named twice (serde refuses it; the caller then reads values);
//! - a number where a field is read rather than skipped (serde would parse it, and can
//!   refuse one out of range);
//! - an escaped key, or a `\u` escape of a UTF-16 surrogate anywhere;
//! - a review field of the wrong type (`"uid": 5`), a struct written as an array;
//! - nesting deeper than 64 levels inside a skipped value.
//!
//! Strings with escapes that it keeps, map values that are not strings and
//! `capabilities.drop` are handed to serde_json on their own span, so they come out exactly
//! as serde reads them. Tests hold the reader to the serde view on hand-written, generated
//! and mangled bodies: where it answers, it answers the same.

use std::borrow::Cow;

use serde_json::Value;

use crate::admission::{GroupVersionKind, GroupVersionResource, PodObject, RequestIn, ReviewIn};
use crate::json_out;
use crate::pod::{
    Capabilities, Container, EnvVar, HostPath, Map, Metadata, PodView, Resources, Scalar,
    SecurityContext, Spec, Volume, VolumeMount,
};

/// The reader gave up; the caller reads the body with serde.
#[derive(Debug)]
struct GiveUp;

type Read<T> = Result<T, GiveUp>;

/// How deep a skipped value may nest before the reader gives up.
const MAX_SKIP_DEPTH: u32 = 64;

/// Reads a review body into `review` (an empty one); `false` when the serde view has to
/// read it instead (see the module docs), and `review` is then to be thrown away.
pub(crate) fn read_review<'a>(text: &'a str, review: &mut ReviewIn<'a, PodObject<'a>>) -> bool {
    let mut scanner = Scanner { text, pos: 0 };
    if scanner.review(review).is_err() {
        return false;
    }
    scanner.whitespace();
    scanner.pos == text.len()
}

/// The request uid, if the body is a JSON object with `request.uid`; "" otherwise. Read by
/// the one-pass reader where it is sure of the body, else by serde.
pub(crate) fn peek_uid(body: &[u8]) -> String {
    std::str::from_utf8(body)
        .ok()
        .and_then(read_uid)
        .or_else(|| serde_uid(body))
        .unwrap_or_default()
}

/// `request.uid` as serde reads it ("" when absent or `null`), or `None` when serde refuses
/// the body.
fn serde_uid(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Review {
        request: Option<Request>,
    }
    #[derive(serde::Deserialize)]
    struct Request {
        uid: Option<String>,
    }
    let review: Review = serde_json::from_slice(body).ok()?;
    Some(review.request.and_then(|r| r.uid).unwrap_or_default())
}

/// Reads only `request.uid` of a review body ("" when absent or `null`), or `None` when the
/// serde reading has to (see the module docs).
fn read_uid(text: &str) -> Option<String> {
    let mut scanner = Scanner { text, pos: 0 };
    let uid = scanner.uid().ok()?;
    scanner.whitespace();
    (scanner.pos == text.len()).then(|| uid.map(Cow::into_owned).unwrap_or_default())
}

/// Which known fields of one object were seen: serde refuses a field named twice.
#[derive(Default)]
struct Seen(u32);

impl Seen {
    fn first(&mut self, field: u32) -> Read<()> {
        let bit = 1 << field;
        if self.0 & bit != 0 {
            return Err(GiveUp);
        }
        self.0 |= bit;
        Ok(())
    }
}

struct Scanner<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Scanner<'a> {
    // -- Tokens -------------------------------------------------------------------------

    fn whitespace(&mut self) {
        let bytes = self.text.as_bytes();
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    /// The first byte of the next token, after whitespace.
    fn peek(&mut self) -> Read<u8> {
        self.whitespace();
        self.text.as_bytes().get(self.pos).copied().ok_or(GiveUp)
    }

    fn eat(&mut self, byte: u8) -> Read<()> {
        if self.peek()? != byte {
            return Err(GiveUp);
        }
        self.pos += 1;
        Ok(())
    }

    fn literal(&mut self, word: &str) -> Read<()> {
        let rest = self.text.as_bytes().get(self.pos..).unwrap_or_default();
        if !rest.starts_with(word.as_bytes()) {
            return Err(GiveUp);
        }
        self.pos += word.len();
        Ok(())
    }

    /// A string at the cursor (on its quote): its contents as written, and whether it has
    /// escapes. Checked as JSON requires, and surrogate escapes give up.
    fn raw_string(&mut self) -> Read<(&'a str, bool)> {
        let bytes = self.text.as_bytes();
        let start = self.pos + 1;
        let mut i = start;
        let mut escaped = false;
        loop {
            i += json_out::first_needing_escape(bytes.get(i..).ok_or(GiveUp)?);
            match *bytes.get(i).ok_or(GiveUp)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    i = escape_end(bytes, i + 1)?;
                }
                0..=0x1f => return Err(GiveUp),
                _ => i += 1,
            }
        }
        self.pos = i + 1;
        let contents = self.text.get(start..i).ok_or(GiveUp)?;
        Ok((contents, escaped))
    }

    /// A string at the cursor, borrowed unless it has escapes.
    fn string(&mut self) -> Read<Cow<'a, str>> {
        let start = self.pos;
        let (contents, escaped) = self.raw_string()?;
        if !escaped {
            return Ok(Cow::Borrowed(contents));
        }
        let quoted = self.text.get(start..self.pos).ok_or(GiveUp)?;
        serde_json::from_str::<String>(quoted)
            .map(Cow::Owned)
            .map_err(|_| GiveUp)
    }

    /// An object key and its colon. An escaped key gives up.
    fn key(&mut self) -> Read<&'a str> {
        if self.peek()? != b'"' {
            return Err(GiveUp);
        }
        let (key, escaped) = self.raw_string()?;
        if escaped {
            return Err(GiveUp);
        }
        self.eat(b':')?;
        Ok(key)
    }

    /// A number, checked against JSON's grammar and skipped.
    fn number(&mut self) -> Read<()> {
        let bytes = self.text.as_bytes();
        let digits = |i: &mut usize| {
            let start = *i;
            while let Some(b'0'..=b'9') = bytes.get(*i) {
                *i += 1;
            }
            *i > start
        };
        let mut i = self.pos;
        if bytes.get(i) == Some(&b'-') {
            i += 1;
        }
        match bytes.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                digits(&mut i);
            }
            _ => return Err(GiveUp),
        }
        if bytes.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                return Err(GiveUp);
            }
        }
        if let Some(b'e' | b'E') = bytes.get(i) {
            i += 1;
            if let Some(b'+' | b'-') = bytes.get(i) {
                i += 1;
            }
            if !digits(&mut i) {
                return Err(GiveUp);
            }
        }
        self.pos = i;
        Ok(())
    }

    // -- Skipping -----------------------------------------------------------------------

    /// Skips one value of any type, checking it.
    fn skip(&mut self) -> Read<()> {
        // One bit per open container: set for an object, clear for an array.
        let mut objects: u64 = 0;
        let mut depth: u32 = 0;
        loop {
            // At a value.
            match self.peek()? {
                open @ (b'{' | b'[') => {
                    self.pos += 1;
                    let close = if open == b'{' { b'}' } else { b']' };
                    if self.peek()? == close {
                        self.pos += 1;
                    } else {
                        if depth == MAX_SKIP_DEPTH {
                            return Err(GiveUp);
                        }
                        objects = (objects << 1) | u64::from(open == b'{');
                        depth += 1;
                        if open == b'{' {
                            self.key()?;
                        }
                        continue;
                    }
                }
                b'"' => {
                    self.raw_string()?;
                }
                b't' => self.literal("true")?,
                b'f' => self.literal("false")?,
                b'n' => self.literal("null")?,
                b'-' | b'0'..=b'9' => self.number()?,
                _ => return Err(GiveUp),
            }
            // After a value: close what ends here, then go on to the next value.
            loop {
                if depth == 0 {
                    return Ok(());
                }
                let in_object = objects & 1 == 1;
                match (self.peek()?, in_object) {
                    (b',', _) => {
                        self.pos += 1;
                        if in_object {
                            self.key()?;
                        }
                        break;
                    }
                    (b'}', true) | (b']', false) => {
                        self.pos += 1;
                        objects >>= 1;
                        depth -= 1;
                    }
                    _ => return Err(GiveUp),
                }
            }
        }
    }

    /// The text of the value at the cursor, skipped.
    fn span(&mut self) -> Read<&'a str> {
        self.whitespace();
        let start = self.pos;
        self.skip()?;
        self.text.get(start..self.pos).ok_or(GiveUp)
    }

    /// A known field of a struct: serde refuses one named twice.
    fn field<T>(
        &mut self,
        seen: &mut Seen,
        index: u32,
        read: impl FnOnce(&mut Self) -> Read<T>,
    ) -> Read<T> {
        seen.first(index)?;
        read(self)
    }

    // -- Containers ---------------------------------------------------------------------

    /// An object at the cursor; `field` reads or skips the value of each key.
    fn object(&mut self, mut field: impl FnMut(&mut Self, &'a str) -> Read<()>) -> Read<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            self.pos += 1;
            return Ok(());
        }
        loop {
            let key = self.key()?;
            field(self, key)?;
            match self.peek()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(GiveUp),
            }
        }
    }

    /// An array at the cursor; `entry` reads or skips each entry.
    fn array(&mut self, mut entry: impl FnMut(&mut Self) -> Read<()>) -> Read<()> {
        self.eat(b'[')?;
        if self.peek()? == b']' {
            self.pos += 1;
            return Ok(());
        }
        loop {
            entry(self)?;
            match self.peek()? {
                b',' => self.pos += 1,
                b']' => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(GiveUp),
            }
        }
    }

    // -- Lenient fields, as in `crate::pod` ---------------------------------------------

    /// A value the field does not take, skipped. Serde parses a number in a read position,
    /// so a number gives up; anything else is skipped as serde skips it.
    fn unwanted(&mut self) -> Read<()> {
        match self.peek()? {
            b'-' | b'0'..=b'9' => Err(GiveUp),
            _ => self.skip(),
        }
    }

    fn text(&mut self) -> Read<Option<Cow<'a, str>>> {
        if self.peek()? == b'"' {
            return self.string().map(Some);
        }
        self.unwanted().map(|()| None)
    }

    fn boolean(&mut self) -> Read<Option<bool>> {
        match self.peek()? {
            b't' => self.literal("true").map(|()| Some(true)),
            b'f' => self.literal("false").map(|()| Some(false)),
            _ => self.unwanted().map(|()| None),
        }
    }

    /// An object read in place into `out` by `read`, or `None` for any other value.
    fn lenient<T: Default>(
        &mut self,
        out: &mut Option<T>,
        read: impl FnOnce(&mut Self, &mut T) -> Read<()>,
    ) -> Read<()> {
        if self.peek()? == b'{' {
            return read(self, out.insert(T::default()));
        }
        *out = None;
        self.unwanted()
    }

    /// A list whose object entries are read in place by `read` and other entries read as
    /// empty ones.
    fn list<T: Default>(
        &mut self,
        out: &mut Option<Vec<T>>,
        read: impl Fn(&mut Self, &mut T) -> Read<()>,
    ) -> Read<()> {
        if self.peek()? != b'[' {
            *out = None;
            return self.unwanted();
        }
        let list = out.insert(Vec::new());
        self.array(|s| {
            list.push(T::default());
            let entry = list.last_mut().ok_or(GiveUp)?;
            if s.peek()? == b'{' {
                read(s, entry)
            } else {
                s.unwanted()
            }
        })
    }

    /// The strings of a list; other entries are skipped, and anything but a list is empty.
    fn texts(&mut self) -> Read<Vec<Cow<'a, str>>> {
        let mut out = Vec::new();
        if self.peek()? != b'[' {
            self.unwanted()?;
            return Ok(out);
        }
        self.array(|s| {
            out.extend(s.text()?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Whether the field is set: present and not `null`. Its content is only skipped.
    fn set(&mut self) -> Read<bool> {
        if self.peek()? == b'n' {
            self.literal("null")?;
            return Ok(false);
        }
        self.skip().map(|()| true)
    }

    /// An object as a [`Map`]: the last of a repeated key wins.
    fn map(&mut self) -> Read<Option<Map<'a>>> {
        if self.peek()? != b'{' {
            return self.unwanted().map(|()| None);
        }
        let mut out = Map::new();
        self.object(|s, key| {
            let value = if s.peek()? == b'"' {
                Scalar::Str(s.string()?)
            } else {
                Scalar::Other(s.value()?)
            };
            out.insert(Cow::Borrowed(key), value);
            Ok(())
        })?;
        Ok(Some(out))
    }

    /// The value at the cursor as serde reads it into a `Value`.
    fn value(&mut self) -> Read<Value> {
        serde_json::from_str(self.span()?).map_err(|_| GiveUp)
    }

    // -- The pod ------------------------------------------------------------------------
    // Each reader fills its struct in place (moving these structs around costs more than
    // reading them) and starts by naming every field of it, so a field added to the view in
    // `crate::pod` does not compile here until the reader reads it.

    fn pod(&mut self, pod: &mut PodView<'a>) -> Read<()> {
        let PodView { metadata, spec } = pod;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "metadata" => s.field(&mut seen, 0, |s| s.lenient(metadata, Self::metadata))?,
                "spec" => s.field(&mut seen, 1, |s| s.lenient(spec, Self::spec))?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn metadata(&mut self, m: &mut Metadata<'a>) -> Read<()> {
        let Metadata {
            name,
            generate_name,
            namespace,
            labels,
            annotations,
        } = m;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "name" => *name = s.field(&mut seen, 0, Self::text)?,
                "generateName" => *generate_name = s.field(&mut seen, 1, Self::text)?,
                "namespace" => *namespace = s.field(&mut seen, 2, Self::text)?,
                "labels" => *labels = s.field(&mut seen, 3, Self::map)?,
                "annotations" => *annotations = s.field(&mut seen, 4, Self::map)?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn spec(&mut self, spec: &mut Spec<'a>) -> Read<()> {
        let Spec {
            service_account_name,
            volumes,
            containers,
            init_containers,
            ephemeral_containers,
        } = spec;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "serviceAccountName" => {
                    *service_account_name = s.field(&mut seen, 0, Self::text)?
                }
                "volumes" => s.field(&mut seen, 1, |s| s.list(volumes, Self::volume))?,
                "containers" => s.field(&mut seen, 2, |s| s.list(containers, Self::container))?,
                "initContainers" => {
                    s.field(&mut seen, 3, |s| s.list(init_containers, Self::container))?
                }
                "ephemeralContainers" => s.field(&mut seen, 4, |s| {
                    s.list(ephemeral_containers, Self::container)
                })?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn volume(&mut self, volume: &mut Volume<'a>) -> Read<()> {
        let Volume { name, host_path } = volume;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "name" => *name = s.field(&mut seen, 0, Self::text)?,
                "hostPath" => s.field(&mut seen, 1, |s| s.lenient(host_path, Self::host_path))?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn host_path(&mut self, host_path: &mut HostPath<'a>) -> Read<()> {
        let HostPath { path } = host_path;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "path" => *path = s.field(&mut seen, 0, Self::text)?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn container(&mut self, c: &mut Container<'a>) -> Read<()> {
        let Container {
            name,
            image,
            env,
            resources,
            security_context,
            volume_mounts,
        } = c;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "name" => *name = s.field(&mut seen, 0, Self::text)?,
                "image" => *image = s.field(&mut seen, 1, Self::text)?,
                "env" => s.field(&mut seen, 2, |s| s.list(env, Self::env_var))?,
                "resources" => s.field(&mut seen, 3, |s| s.lenient(resources, Self::resources))?,
                "securityContext" => s.field(&mut seen, 4, |s| {
                    s.lenient(security_context, Self::security_context)
                })?,
                "volumeMounts" => {
                    s.field(&mut seen, 5, |s| s.list(volume_mounts, Self::volume_mount))?
                }
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn env_var(&mut self, var: &mut EnvVar<'a>) -> Read<()> {
        let EnvVar {
            name,
            value,
            value_from,
        } = var;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "name" => *name = s.field(&mut seen, 0, Self::text)?,
                "value" => *value = s.field(&mut seen, 1, Self::text)?,
                "valueFrom" => *value_from = s.field(&mut seen, 2, Self::set)?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn resources(&mut self, resources: &mut Resources<'a>) -> Read<()> {
        let Resources { limits, requests } = resources;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "limits" => *limits = s.field(&mut seen, 0, Self::map)?,
                "requests" => *requests = s.field(&mut seen, 1, Self::map)?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn security_context(&mut self, context: &mut SecurityContext<'a>) -> Read<()> {
        let SecurityContext {
            privileged,
            capabilities,
        } = context;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "privileged" => *privileged = s.field(&mut seen, 0, Self::boolean)?,
                "capabilities" => s.field(&mut seen, 1, |s| {
                    s.lenient(capabilities, Self::capabilities)
                })?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn capabilities(&mut self, caps: &mut Capabilities<'a>) -> Read<()> {
        let Capabilities { add, drop } = caps;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "add" => *add = s.field(&mut seen, 0, Self::texts)?,
                "drop" => *drop = Some(s.field(&mut seen, 1, Self::value)?),
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn volume_mount(&mut self, mount: &mut VolumeMount<'a>) -> Read<()> {
        let VolumeMount { name } = mount;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "name" => *name = s.field(&mut seen, 0, Self::text)?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    // -- The review ---------------------------------------------------------------------

    fn review(&mut self, review: &mut ReviewIn<'a, PodObject<'a>>) -> Read<()> {
        let ReviewIn {
            api_version,
            kind,
            request,
        } = review;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "apiVersion" => *api_version = s.field(&mut seen, 0, Self::optional_string)?,
                "kind" => *kind = s.field(&mut seen, 1, Self::optional_string)?,
                "request" => s.field(&mut seen, 2, |s| {
                    s.optional_in_place(request, Self::request)
                })?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    /// `request.uid` of a review whose other fields are only skipped.
    fn uid(&mut self) -> Read<Option<Cow<'a, str>>> {
        let mut uid = None;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "request" => {
                    uid = s
                        .field(&mut seen, 0, |s| {
                            s.optional(|s| {
                                let mut uid = None;
                                let mut seen = Seen::default();
                                s.object(|s, key| {
                                    match key {
                                        "uid" => {
                                            uid = s.field(&mut seen, 0, Self::optional_string)?
                                        }
                                        _ => s.skip()?,
                                    }
                                    Ok(())
                                })?;
                                Ok(uid)
                            })
                        })?
                        .flatten();
                }
                _ => s.skip()?,
            }
            Ok(())
        })?;
        Ok(uid)
    }

    fn request(&mut self, r: &mut RequestIn<'a, PodObject<'a>>) -> Read<()> {
        let RequestIn {
            uid,
            kind,
            resource,
            sub_resource,
            name,
            namespace,
            operation,
            object,
            old_object,
        } = r;
        let mut seen = Seen::default();
        self.object(|s, key| {
            match key {
                "uid" => *uid = s.field(&mut seen, 0, Self::optional_string)?,
                "kind" => *kind = s.field(&mut seen, 1, |s| s.optional(Self::kind))?,
                "resource" => *resource = s.field(&mut seen, 2, |s| s.optional(Self::resource))?,
                "subResource" => *sub_resource = s.field(&mut seen, 3, Self::optional_string)?,
                "name" => *name = s.field(&mut seen, 4, Self::optional_string)?,
                "namespace" => *namespace = s.field(&mut seen, 5, Self::optional_string)?,
                "operation" => *operation = s.field(&mut seen, 6, Self::optional_string)?,
                "object" => s.field(&mut seen, 7, |s| s.pod_object(object))?,
                "oldObject" => s.field(&mut seen, 8, |s| s.pod_object(old_object))?,
                _ => s.skip()?,
            }
            Ok(())
        })
    }

    fn kind(&mut self) -> Read<GroupVersionKind<'a>> {
        let (group, kind) = self.group_and("kind")?;
        Ok(GroupVersionKind { group, kind })
    }

    fn resource(&mut self) -> Read<GroupVersionResource<'a>> {
        let (group, resource) = self.group_and("resource")?;
        Ok(GroupVersionResource { group, resource })
    }

    /// `group` and one other string field, both defaulting to "".
    fn group_and(&mut self, other: &str) -> Read<(Cow<'a, str>, Cow<'a, str>)> {
        let (mut group, mut value) = (Cow::Borrowed(""), Cow::Borrowed(""));
        let mut seen = Seen::default();
        self.object(|s, key| {
            if key == "group" {
                group = s.field(&mut seen, 0, Self::required_string)?;
            } else if key == other {
                value = s.field(&mut seen, 1, Self::required_string)?;
            } else {
                s.skip()?;
            }
            Ok(())
        })?;
        Ok((group, value))
    }

    /// `request.object` or `request.oldObject`: `null` is absent, an object is the pod's
    /// view, anything else an empty one.
    fn pod_object(&mut self, out: &mut Option<PodObject<'a>>) -> Read<()> {
        if self.peek()? == b'n' {
            *out = None;
            return self.literal("null");
        }
        let object = out.insert(PodObject(None));
        self.lenient(&mut object.0, Self::pod)
    }

    /// An object read in place into `out` by `read`, `null` as `None`; anything else gives
    /// up.
    fn optional_in_place<T: Default>(
        &mut self,
        out: &mut Option<T>,
        read: impl FnOnce(&mut Self, &mut T) -> Read<()>,
    ) -> Read<()> {
        match self.peek()? {
            b'n' => {
                *out = None;
                self.literal("null")
            }
            b'{' => read(self, out.insert(T::default())),
            _ => Err(GiveUp),
        }
    }

    /// An object read by `read`, `null` as `None`; anything else gives up.
    fn optional<T>(&mut self, read: impl FnOnce(&mut Self) -> Read<T>) -> Read<Option<T>> {
        match self.peek()? {
            b'n' => self.literal("null").map(|()| None),
            b'{' => read(self).map(Some),
            _ => Err(GiveUp),
        }
    }

    /// A string, `null` as `None`; anything else gives up.
    fn optional_string(&mut self) -> Read<Option<Cow<'a, str>>> {
        match self.peek()? {
            b'n' => self.literal("null").map(|()| None),
            b'"' => self.string().map(Some),
            _ => Err(GiveUp),
        }
    }

    /// A string; anything else gives up.
    fn required_string(&mut self) -> Read<Cow<'a, str>> {
        if self.peek()? != b'"' {
            return Err(GiveUp);
        }
        self.string()
    }
}

/// The index after the escape whose letter is at `i`. A `\u` escape of a UTF-16 surrogate
/// gives up: serde refuses a lone one in a string it reads, and the reader does not pair them.
fn escape_end(bytes: &[u8], i: usize) -> Read<usize> {
    match bytes.get(i) {
        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(i + 1),
        Some(b'u') => {
            let hex = bytes.get(i + 1..i + 5).ok_or(GiveUp)?;
            let mut unit: u32 = 0;
            for &digit in hex {
                unit = unit * 16 + char::from(digit).to_digit(16).ok_or(GiveUp)?;
            }
            if (0xD800..0xE000).contains(&unit) {
                return Err(GiveUp);
            }
            Ok(i + 5)
        }
        _ => Err(GiveUp),
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    use super::*;

    /// The serde view of a body: what `handle_review` reads when the reader gives up.
    fn serde_view(text: &str) -> Option<ReviewIn<'_, PodObject<'_>>> {
        serde_json::from_str(text).ok()
    }

    /// The reader's reading of a body, when it takes it.
    fn read(text: &str) -> Option<ReviewIn<'_, PodObject<'_>>> {
        let mut review = ReviewIn::default();
        read_review(text, &mut review).then_some(review)
    }

    /// Holds both readers to serde; returns whether the review reader read the body.
    fn check(text: &str) -> bool {
        if let Some(uid) = read_uid(text) {
            assert_eq!(Some(uid), serde_uid(text.as_bytes()), "body: {text}");
        }
        let Some(fast) = read(text) else {
            return false;
        };
        assert_eq!(Some(fast), serde_view(text), "body: {text}");
        true
    }

    fn review(object: Value) -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "namespace": "ml",
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                             "groups": ["system:serviceaccounts", "system:authenticated"]},
                "object": object,
                "oldObject": null,
                "dryRun": false,
                "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
            }
        })
    }

    /// A pod as the API server sends it, with the fields the engine reads and many it skips.
    fn training_pod() -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": "train-7d9f-",
                "namespace": "ml",
                "labels": {"app": "train", "pod-template-hash": "7d9f"},
                "annotations": {"nvidia.com/gpu.count": "2", "note": "a \"quoted\" <value> & more"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "train-7d9f",
                                     "uid": "0d1c", "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                                   "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}}}}]
            },
            "spec": {
                "serviceAccountName": "trainer",
                "volumes": [
                    {"name": "dev", "hostPath": {"path": "/dev/nvidia0", "type": "CharDevice"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                    {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}
                ],
                "initContainers": [{"name": "fetch", "image": "busybox:1.36", "command": ["sh", "-c", "wget -O /data/x http://x && echo ok"]}],
                "containers": [
                    {
                        "name": "trainer",
                        "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                        "args": ["--epochs", "10", "--lr=3e-4"],
                        "env": [
                            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"},
                            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
                            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "EMPTY", "valueFrom": null},
                            {"name": "TABBED", "value": "a\tb\nc é ✓"}
                        ],
                        "ports": [{"containerPort": 29500, "protocol": "TCP"}],
                        "resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
                                      "requests": {"cpu": "8", "memory": "64Gi"}},
                        "securityContext": {"privileged": true, "runAsUser": 0,
                                            "capabilities": {"add": ["SYS_ADMIN", "CAP_IPC_LOCK"], "drop": ["NET_RAW"]}},
                        "volumeMounts": [{"name": "dev", "mountPath": "/dev/nvidia0"},
                                         {"name": "data", "mountPath": "/data", "readOnly": true}],
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 10}
                    },
                    {"name": "sidecar", "image": "logger:1", "securityContext": {"privileged": false}}
                ],
                "ephemeralContainers": [],
                "terminationGracePeriodSeconds": 30,
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            }
        })
    }

    #[test]
    fn reads_a_pod_review_as_serde_does() {
        let text = review(training_pod()).to_string();
        let fast = read(&text).expect("the reader takes a plain review");
        let pod = fast.request.as_ref().unwrap().object.as_ref().unwrap();
        let containers = pod
            .0
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .containers
            .as_ref();
        assert_eq!(containers.map(Vec::len), Some(2));
        assert!(check(&text));
        // Pretty-printed, with whitespace everywhere JSON allows it.
        assert!(check(
            &serde_json::to_string_pretty(&review(training_pod())).unwrap()
        ));
    }

    #[test]
    fn reads_the_uid_alone_as_serde_does() {
        let text = review(training_pod()).to_string();
        assert_eq!(
            read_uid(&text).as_deref(),
            Some("705ab4f5-6393-11e8-b7cc-42010a800002")
        );
        for text in [
            r#"{"request": {"uid": null}}"#,
            r#"{"request": null, "x": [1, {"uid": "no"}]}"#,
            r#"{"request": {"object": {"uid": "no"}}}"#,
            r#"{}"#,
        ] {
            assert_eq!(read_uid(text).as_deref(), Some(""), "{text}");
        }
        for text in [
            r#"{"request": {"uid": 5}}"#,
            r#"{"request": {"uid": "a", "uid": "b"}}"#,
            r#"{"request": []}"#,
            r#"{"request": {}} x"#,
        ] {
            assert_eq!(read_uid(text), None, "{text}");
        }
    }

    #[test]
    fn reads_wrong_types_and_escapes_as_serde_does() {
        let odd = json!({
            "metadata": {"name": "n\u{e9}\"x\"", "namespace": ["ml"], "labels": {"a": 1, "b": "2", "c": null,
                         "d": {"x": [1, 2.5, -3e2]}, "a": "again"}, "annotations": "x"},
            "spec": {
                "serviceAccountName": {"name": "sa"},
                "volumes": {"name": "v"},
                "containers": [
                    "not a container", null, true, [], {},
                    {
                        "name": "c\\d/e\u{1}",
                        "env": [null, {"name": "A", "value": true, "valueFrom": null},
                                {"name": "B", "valueFrom": {"fieldRef": {}}}, {"valueFrom": 0}],
                        "resources": {"limits": [], "requests": {"nvidia.com/gpu": 2, "cpu": "1"}},
                        "securityContext": {"privileged": "true",
                                            "capabilities": {"add": ["A", null, "B", {}, []], "drop": null}},
                        "volumeMounts": "m"
                    },
                    {"securityContext": {"privileged": null, "capabilities": {"add": "ALL", "drop": {"x": 1}}}}
                ],
                "initContainers": null,
                "ephemeralContainers": {}
            }
        });
        assert!(check(&review(odd).to_string()));
        // Escapes serde_json does not write: \u for plain text and \/.
        let escaped = review(training_pod())
            .to_string()
            .replace("trainer", r"tr\u0061iner")
            .replace("/dev/nvidia0", r"\/dev\/nvidia0")
            .replace("&", r"\u0026");
        assert!(check(&escaped));
        // Other objects: a string, a number deep inside a skipped value, an empty review.
        for object in [
            json!("pod"),
            json!({"spec": {"x": [[["huge"]]]}}),
            json!([1, 2]),
        ] {
            let text = review(object).to_string().replace(r#""huge""#, "1e400");
            assert!(check(&text));
        }
        assert!(check("{}"));
        assert!(check(r#"{"request": null, "kind": null}"#));
    }

    #[test]
    fn gives_up_where_serde_refuses_or_reads_otherwise() {
        let body = review(training_pod()).to_string();
        let edits: &[(&str, &str)] = &[
            // A field named twice in a struct: serde refuses; the caller reads values.
            (
                r#""privileged":true"#,
                r#""privileged":true,"privileged":false"#,
            ),
            (r#""uid":"705"#, r#""uid":"x","uid":"705"#),
            // A number where a value is read.
            (r#""name":"trainer""#, r#""name":1e400"#),
            (r#""name":"trainer""#, r#""name":7"#),
            (r#""value":"0,1""#, r#""value":-0.5"#),
            // Review fields of the wrong type.
            (
                r#""uid":"705ab4f5-6393-11e8-b7cc-42010a800002""#,
                r#""uid":5"#,
            ),
            (r#""operation":"CREATE""#, r#""operation":["CREATE"]"#),
            (
                r#""kind":{"group":"","kind":"Pod","version":"v1"}"#,
                r#""kind":["","v1","Pod"]"#,
            ),
            (r#""group":"","kind":"Pod""#, r#""group":null,"kind":"Pod""#),
            // Escaped keys, surrogate escapes, control characters.
            (r#""image":"#, r#""im\u0061ge":"#),
            (r#""app":"train""#, r#""app":"\ud83d\ude00""#),
            (r#""runAsUser":0"#, r#""runAsUser":"\udc00""#),
            ("logger:1", "logger\u{1}:1"),
            // Not JSON.
            (r#""readOnly":true"#, r#""readOnly":tru"#),
            (r#""periodSeconds":10"#, r#""periodSeconds":010"#),
            (r#""periodSeconds":10"#, r#""periodSeconds":1."#),
            (r#""protocol":"TCP"}"#, r#""protocol":"TCP",}"#),
            (r#""args":["--epochs""#, r#""args":[,"--epochs""#),
            (r#""note":"#, r#""note" "#),
            (r#"\"quoted\""#, r#"\q"#),
        ];
        for (from, to) in edits {
            assert!(body.contains(from), "{from}");
            let text = body.replacen(from, to, 1);
            assert!(read(&text).is_none(), "read: {to}");
        }
        let deep = format!("{}1{}", "[".repeat(70), "]".repeat(70));
        for text in [
            "",
            "[]",
            "null",
            r#"{"kind":"AdmissionReview"} x"#,
            r#"{"kind":"AdmissionReview"}{}"#,
            &review(json!({"spec": {"x": serde_json::from_str::<Value>(&deep).unwrap()}}))
                .to_string(),
        ] {
            assert!(read(text).is_none(), "read: {text}");
        }
    }

    #[test]
    fn mangled_bodies_read_as_serde_reads_them() {
        let seeds = [
            review(training_pod()).to_string(),
            serde_json::to_string_pretty(&review(training_pod())).unwrap(),
            review(json!({"metadata": {"labels": {"a": 1}}, "spec": {"containers": [1, "x", {"env": [2]}]}}))
                .to_string(),
        ];
        let noise: &[&str] = &[
            "{",
            "}",
            "[",
            "]",
            "\"",
            ",",
            ":",
            "\\",
            "\\u",
            "\\ud800",
            "\\u00e9",
            "\\n",
            "0",
            "-",
            "1e400",
            "1.",
            "null",
            "true",
            " ",
            "\u{1}",
            "é",
            r#""name":"x","#,
            r#""privileged":true,"#,
            r#""uid":5,"#,
            r#""env":null,"#,
        ];
        let mut rng = StdRng::seed_from_u64(0x5CA7);
        let (mut read, mut total) = (0, 0);
        for _ in 0..20_000 {
            let mut text = seeds[rng.random_range(0..seeds.len())].clone();
            for _ in 0..rng.random_range(1..4) {
                if text.is_empty() {
                    break;
                }
                let at = boundary(&text, rng.random_range(0..=text.len()));
                match rng.random_range(0..4) {
                    0 => {
                        let end = boundary(&text, (at + rng.random_range(1..4)).min(text.len()));
                        text.replace_range(at..end, "");
                    }
                    1 => text.insert_str(at, noise[rng.random_range(0..noise.len())]),
                    2 => {
                        // A copy of another span: repeated fields and misplaced values.
                        let from = boundary(&text, rng.random_range(0..text.len()));
                        let to = boundary(&text, (from + rng.random_range(1..40)).min(text.len()));
                        let span = text[from..to].to_owned();
                        text.insert_str(at, &span);
                    }
                    _ => text.truncate(at),
                }
            }
            total += 1;
            if check(&text) {
                read += 1;
            }
        }
        // Most edits break the JSON; the reader must still read a fair share of the rest.
        assert!(read > total / 20, "read {read} of {total}");
    }

    /// `at`, moved back to a char boundary of `text`.
    fn boundary(text: &str, mut at: usize) -> usize {
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        at
    }
}
