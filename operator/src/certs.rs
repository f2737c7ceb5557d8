//! The webhook's CA and serving certificate, as a pure function of the Secret's current data
//! and the time: [`plan`] says what the Secret should hold and why it changed.
//!
//! Rotation rules: a certificate is renewed when less than a third of its lifetime is left.
//! A new CA is put in front of the old one in `ca.crt` (the `caBundle`), and the old CA stays
//! there until it expires, so API servers that still have the old bundle keep trusting the
//! serving certificate while the new bundle propagates.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData,
};
use x509_parser::certificate::X509Certificate;
use x509_parser::pem::Pem;

/// Secret key of the serving certificate (PEM).
pub const TLS_CRT: &str = "tls.crt";
/// Secret key of the serving certificate's private key (PEM, PKCS#8).
pub const TLS_KEY: &str = "tls.key";
/// Secret key of every CA certificate still trusted, newest first (PEM bundle).
pub const CA_CRT: &str = "ca.crt";
/// Secret key of the current CA's private key (PEM, PKCS#8). The webhook needs only
/// `tls.crt` and `tls.key`; its volume should project just those (`items:`) so the CA key
/// never reaches the webhook's filesystem.
pub const CA_KEY: &str = "ca.key";

/// The CA lives this many times longer than the serving certificate it signs.
pub const CA_LIFETIME_FACTOR: u32 = 4;
/// Certificates are backdated by this much, for clocks that run slightly behind.
const BACKDATE: Duration = Duration::from_secs(300);

/// A certificate operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen refused to generate a key or certificate.
    #[error("failed to generate {what}")]
    Generate {
        /// What was being generated.
        what: &'static str,
        /// The rcgen error.
        #[source]
        source: rcgen::Error,
    },
    /// The validity period does not fit a certificate.
    #[error("certificate validity {0:?} is out of range (use at least 1h)")]
    Validity(Duration),
}

/// What the certificates are for.
#[derive(Clone, Debug)]
pub struct CertParams {
    /// Namespace of the webhook Service.
    pub namespace: String,
    /// Name of the webhook Service.
    pub service: String,
    /// Lifetime of a serving certificate; the CA lives [`CA_LIFETIME_FACTOR`] times longer.
    pub validity: Duration,
}

impl CertParams {
    /// The DNS names the serving certificate must cover.
    pub fn dns_names(&self) -> Vec<String> {
        let (s, ns) = (&self.service, &self.namespace);
        vec![
            s.clone(),
            format!("{s}.{ns}"),
            format!("{s}.{ns}.svc"),
            format!("{s}.{ns}.svc.cluster.local"),
        ]
    }
}

/// What the Secret should hold.
#[derive(Clone, Debug)]
pub struct CertPlan {
    /// Full Secret data (`tls.crt`, `tls.key`, `ca.crt`, `ca.key`).
    pub data: BTreeMap<String, Vec<u8>>,
    /// The `caBundle` for the webhook configuration (same as `ca.crt`).
    pub ca_bundle: Vec<u8>,
    /// Why anything changed; empty when `data` equals the input.
    pub reasons: Vec<String>,
    /// When the next renewal is due (the earlier of the CA's and the serving certificate's).
    pub next_renewal: Timestamp,
}

impl CertPlan {
    /// Whether the Secret needs writing.
    pub fn changed(&self) -> bool {
        !self.reasons.is_empty()
    }
}

/// A parsed certificate with what the plan needs from it.
struct Parsed {
    pem: String,
    der: Vec<u8>,
    not_before: i64,
    not_after: i64,
}

impl Parsed {
    fn x509(&self) -> Option<X509Certificate<'_>> {
        x509_parser::parse_x509_certificate(&self.der)
            .ok()
            .map(|(_, c)| c)
    }

    /// The moment a third of the lifetime is left.
    fn renew_at(&self) -> i64 {
        self.not_after - (self.not_after - self.not_before) / 3
    }
}

fn parse_bundle(bytes: Option<&Vec<u8>>) -> Vec<Parsed> {
    let Some(bytes) = bytes else {
        return Vec::new();
    };
    Pem::iter_from_buffer(bytes)
        .filter_map(Result::ok)
        .filter(|p| p.label == "CERTIFICATE")
        .filter_map(|p| {
            let cert = p.parse_x509().ok()?;
            let validity = cert.validity();
            Some(Parsed {
                pem: pem_encode("CERTIFICATE", &p.contents),
                not_before: validity.not_before.timestamp(),
                not_after: validity.not_after.timestamp(),
                der: p.contents.clone(),
            })
        })
        .collect()
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len() * 4 / 3 + 4);
    for chunk in der.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(char::from(B64[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn key_from(bytes: Option<&Vec<u8>>) -> Option<KeyPair> {
    let text = std::str::from_utf8(bytes?).ok()?;
    KeyPair::from_pem(text).ok()
}

fn spki_matches(cert: &X509Certificate<'_>, key: &KeyPair) -> bool {
    cert.public_key().raw == key.subject_public_key_info().as_slice()
}

fn offset(ts: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(ts).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn validity_secs(d: Duration) -> Result<i64, CertError> {
    let secs = i64::try_from(d.as_secs()).map_err(|_| CertError::Validity(d))?;
    if !(3600..=100 * 365 * 86400).contains(&secs) {
        return Err(CertError::Validity(d));
    }
    Ok(secs)
}

fn generate_key(what: &'static str) -> Result<KeyPair, CertError> {
    KeyPair::generate().map_err(|source| CertError::Generate { what, source })
}

fn ca_params(now: i64, lifetime: i64) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "gpuwarden");
    dn.push(
        DnType::CommonName,
        format!("gpuwarden webhook CA {}", offset(now).date()),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = offset(now - BACKDATE.as_secs() as i64);
    params.not_after = offset(now + lifetime);
    params
}

/// Computes what the webhook TLS Secret should hold at `now`, given what it holds.
pub fn plan(
    existing: &BTreeMap<String, Vec<u8>>,
    now: Timestamp,
    params: &CertParams,
) -> Result<CertPlan, CertError> {
    let now_s = now.as_second();
    let leaf_life = validity_secs(params.validity)?;
    let ca_life = leaf_life.saturating_mul(i64::from(CA_LIFETIME_FACTOR));
    let mut reasons = Vec::new();

    let bundle = parse_bundle(existing.get(CA_CRT));
    let ca = current_or_new_ca(existing, &bundle, now_s, ca_life, &mut reasons)?;
    let serving = current_or_new_serving(existing, &ca, params, now_s, leaf_life, &mut reasons)?;
    let ca_bundle = trusted_bundle(&ca, &bundle, now_s);

    let mut data = BTreeMap::new();
    data.insert(TLS_CRT.to_owned(), serving.crt.into_bytes());
    data.insert(TLS_KEY.to_owned(), serving.key.into_bytes());
    data.insert(CA_CRT.to_owned(), ca_bundle.clone().into_bytes());
    data.insert(CA_KEY.to_owned(), ca.key.serialize_pem().into_bytes());
    // Keys other writers put in the Secret are theirs; only ours are compared.
    let ours_unchanged = data.iter().all(|(k, v)| existing.get(k) == Some(v));
    if reasons.is_empty() && !ours_unchanged {
        // Same certificates, different bytes (whitespace, an expired CA dropped from the bundle).
        reasons.push("secret data normalised (expired CAs dropped)".to_owned());
    }
    let next = ca.renew_at.min(serving.renew_at);
    Ok(CertPlan {
        data,
        ca_bundle: ca_bundle.into_bytes(),
        reasons,
        next_renewal: Timestamp::from_second(next).unwrap_or(now),
    })
}

/// The CA that signs the serving certificate.
struct Ca {
    key: KeyPair,
    pem: String,
    der: Vec<u8>,
    /// When a third of its lifetime is left.
    renew_at: i64,
}

/// The current CA: the bundle's certificate that matches `ca.key`, still in its first two
/// thirds of life. Otherwise a new CA, and the reason for it in `reasons`.
fn current_or_new_ca(
    existing: &BTreeMap<String, Vec<u8>>,
    bundle: &[Parsed],
    now_s: i64,
    ca_life: i64,
    reasons: &mut Vec<String>,
) -> Result<Ca, CertError> {
    let ca_key = key_from(existing.get(CA_KEY));
    let current = ca_key.as_ref().and_then(|key| {
        bundle
            .iter()
            .position(|c| c.x509().is_some_and(|x| x.is_ca() && spki_matches(&x, key)))
    });
    match (ca_key, current) {
        (Some(key), Some(i)) if bundle[i].renew_at() > now_s && bundle[i].not_before <= now_s => {
            let c = &bundle[i];
            Ok(Ca {
                key,
                pem: c.pem.clone(),
                der: c.der.clone(),
                renew_at: c.renew_at(),
            })
        }
        (key, current) => {
            reasons.push(match (key, current) {
                (None, _) if existing.is_empty() => "no CA yet".to_owned(),
                (None, _) => "CA key missing or unreadable".to_owned(),
                (Some(_), None) => "CA certificate missing or does not match the CA key".to_owned(),
                (Some(_), Some(_)) => "CA has less than a third of its lifetime left".to_owned(),
            });
            new_ca(now_s, ca_life)
        }
    }
}

/// A new self-signed CA living `ca_life` from `now_s`.
fn new_ca(now_s: i64, ca_life: i64) -> Result<Ca, CertError> {
    let key = generate_key("CA key")?;
    let cert = ca_params(now_s, ca_life)
        .self_signed(&key)
        .map_err(|source| CertError::Generate {
            what: "CA certificate",
            source,
        })?;
    Ok(Ca {
        pem: cert.pem(),
        der: cert.der().to_vec(),
        renew_at: now_s + ca_life - (ca_life + BACKDATE.as_secs() as i64) / 3,
        key,
    })
}

/// The serving certificate and its key, as PEM.
struct Serving {
    crt: String,
    key: String,
    /// When a third of its lifetime is left.
    renew_at: i64,
}

/// The serving certificate: kept while it is signed by the current CA, has the right names,
/// matches its key, and has more than a third of its life left. Otherwise a new one, and the
/// reason for it in `reasons`.
fn current_or_new_serving(
    existing: &BTreeMap<String, Vec<u8>>,
    ca: &Ca,
    params: &CertParams,
    now_s: i64,
    leaf_life: i64,
    reasons: &mut Vec<String>,
) -> Result<Serving, CertError> {
    let serving = parse_bundle(existing.get(TLS_CRT)).into_iter().next();
    let serving_key = key_from(existing.get(TLS_KEY));
    let ca_parsed = x509_parser::parse_x509_certificate(&ca.der)
        .ok()
        .map(|(_, c)| c);
    let keep = match (&serving, &serving_key, &ca_parsed) {
        (Some(s), Some(k), Some(ca_x509)) => match serving_problem(s, k, ca_x509, params, now_s) {
            Some(p) => {
                reasons.push(p.to_owned());
                false
            }
            None => true,
        },
        _ => {
            if !existing.is_empty() {
                reasons.push("serving certificate or key missing".to_owned());
            }
            false
        }
    };
    match (keep, serving, serving_key) {
        (true, Some(s), Some(k)) => Ok(Serving {
            crt: s.pem.clone(),
            key: k.serialize_pem(),
            renew_at: s.renew_at(),
        }),
        _ => new_serving(ca, ca_parsed.as_ref(), params, now_s, leaf_life),
    }
}

/// Why the serving certificate `s` with key `key` cannot stay under the CA `ca`; `None`
/// when it can.
fn serving_problem(
    s: &Parsed,
    key: &KeyPair,
    ca: &X509Certificate<'_>,
    params: &CertParams,
    now_s: i64,
) -> Option<&'static str> {
    let Some(x) = s.x509() else {
        return Some("serving certificate unreadable");
    };
    let mut expected_names = params.dns_names();
    expected_names.sort();
    if !spki_matches(&x, key) {
        Some("serving certificate does not match its key")
    } else if x.verify_signature(Some(ca.public_key())).is_err() {
        Some("serving certificate is not signed by the current CA")
    } else if dns_names(&x) != expected_names {
        Some("serving certificate names differ from the webhook Service's")
    } else if s.renew_at() <= now_s || s.not_before > now_s {
        Some("serving certificate has less than a third of its lifetime left")
    } else {
        None
    }
}

/// The DNS names among a certificate's subject alternative names, sorted.
fn dns_names(x: &X509Certificate<'_>) -> Vec<String> {
    let mut names: Vec<String> = x
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|g| match g {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some((*d).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A new serving certificate for the webhook Service, signed by `ca` and living `leaf_life`
/// from `now_s`, but never beyond the CA.
fn new_serving(
    ca: &Ca,
    ca_x509: Option<&X509Certificate<'_>>,
    params: &CertParams,
    now_s: i64,
    leaf_life: i64,
) -> Result<Serving, CertError> {
    let key = generate_key("serving key")?;
    // Never outlive the CA that signs it.
    let ca_not_after = ca_x509.map_or(now_s + leaf_life, |c| c.validity().not_after.timestamp());
    let not_after = (now_s + leaf_life).min(ca_not_after);
    let p = serving_params(params, now_s, not_after)?;
    let issuer = Issuer::from_ca_cert_der(&ca.der.clone().into(), &ca.key).map_err(|source| {
        CertError::Generate {
            what: "CA issuer",
            source,
        }
    })?;
    let cert = p
        .signed_by(&key, &issuer)
        .map_err(|source| CertError::Generate {
            what: "serving certificate",
            source,
        })?;
    let lifetime = not_after - (now_s - BACKDATE.as_secs() as i64);
    Ok(Serving {
        crt: cert.pem(),
        key: key.serialize_pem(),
        renew_at: not_after - lifetime / 3,
    })
}

/// What a serving certificate for the webhook Service says: its names, a server's key
/// usages, and its validity (backdated).
fn serving_params(
    params: &CertParams,
    now_s: i64,
    not_after: i64,
) -> Result<CertificateParams, CertError> {
    let mut p =
        CertificateParams::new(params.dns_names()).map_err(|source| CertError::Generate {
            what: "serving certificate names",
            source,
        })?;
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(
        DnType::CommonName,
        format!("{}.{}.svc", params.service, params.namespace),
    );
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    p.use_authority_key_identifier_extension = true;
    p.not_before = offset(now_s - BACKDATE.as_secs() as i64);
    p.not_after = offset(not_after);
    Ok(p)
}

/// The `caBundle`: the current CA first, then every other CA that has not expired yet, three
/// at most.
fn trusted_bundle(ca: &Ca, bundle: &[Parsed], now_s: i64) -> String {
    let ca_spki: Vec<u8> = ca.key.subject_public_key_info();
    let mut ca_bundle = ca.pem.clone();
    let mut kept = 1;
    for old in bundle {
        let is_current = x509_parser::parse_x509_certificate(&old.der)
            .ok()
            .is_some_and(|(_, x)| x.public_key().raw == ca_spki.as_slice());
        if is_current || old.not_after <= now_s || kept >= 3 {
            continue;
        }
        ca_bundle.push_str(&old.pem);
        kept += 1;
    }
    ca_bundle
}

/// Number of certificates in a PEM bundle.
pub fn bundle_len(bundle: &[u8]) -> usize {
    Pem::iter_from_buffer(bundle)
        .filter_map(Result::ok)
        .filter(|p| p.label == "CERTIFICATE")
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86400;

    fn params() -> CertParams {
        CertParams {
            namespace: "gpuwarden-system".into(),
            service: "gpuwarden-webhook".into(),
            validity: Duration::from_secs(90 * DAY as u64),
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn serving(data: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
        data[TLS_CRT].clone()
    }

    #[test]
    fn first_plan_creates_ca_and_serving_cert_with_service_names() {
        let p = plan(&BTreeMap::new(), at(0), &params()).unwrap();
        assert!(p.changed());
        assert_eq!(bundle_len(&p.ca_bundle), 1);
        let crt = parse_bundle(Some(&p.data[TLS_CRT]));
        let x = crt[0].x509().unwrap();
        let san = x.subject_alternative_name().unwrap().unwrap();
        let mut names: Vec<String> = san
            .value
            .general_names
            .iter()
            .filter_map(|g| match g {
                x509_parser::extensions::GeneralName::DNSName(d) => Some((*d).to_owned()),
                _ => None,
            })
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "gpuwarden-webhook",
                "gpuwarden-webhook.gpuwarden-system",
                "gpuwarden-webhook.gpuwarden-system.svc",
                "gpuwarden-webhook.gpuwarden-system.svc.cluster.local",
            ]
        );
        let ca = parse_bundle(Some(&p.ca_bundle));
        assert!(
            x.verify_signature(Some(ca[0].x509().unwrap().public_key()))
                .is_ok()
        );
        assert_eq!(crt[0].not_after - at(0).as_second(), 90 * DAY);
    }

    #[test]
    fn nothing_changes_while_certificates_are_fresh() {
        let first = plan(&BTreeMap::new(), at(0), &params()).unwrap();
        let again = plan(&first.data, at(30 * DAY), &params()).unwrap();
        assert!(!again.changed(), "{:?}", again.reasons);
        assert_eq!(again.data, first.data);
    }

    #[test]
    fn serving_cert_renewed_when_a_third_of_life_is_left() {
        let first = plan(&BTreeMap::new(), at(0), &params()).unwrap();
        // 90-day certificate: renewal is due 60 days in (plus the 5 minute backdate).
        let p = plan(&first.data, at(61 * DAY), &params()).unwrap();
        assert!(p.changed());
        assert_ne!(serving(&p.data), serving(&first.data));
        // The CA (360 days) is still fresh: same CA, one CA in the bundle.
        assert_eq!(p.data[CA_KEY], first.data[CA_KEY]);
        assert_eq!(bundle_len(&p.ca_bundle), 1);
        assert!(
            p.reasons.iter().any(|r| r.contains("third")),
            "{:?}",
            p.reasons
        );
    }

    #[test]
    fn ca_rollover_keeps_both_cas_in_the_bundle_until_the_old_one_expires() {
        let first = plan(&BTreeMap::new(), at(0), &params()).unwrap();
        // CA lives 360 days; it is renewed after 240.
        let mut data = first.data.clone();
        let mut t = 0;
        while t < 241 * DAY {
            t += 20 * DAY;
            data = plan(&data, at(t), &params()).unwrap().data;
        }
        let rolled = plan(&data, at(t), &params()).unwrap();
        assert_ne!(
            rolled.data[CA_KEY], first.data[CA_KEY],
            "CA should have rolled"
        );
        assert_eq!(
            bundle_len(&rolled.ca_bundle),
            2,
            "old and new CA both trusted"
        );
        let bundle = parse_bundle(Some(&rolled.ca_bundle));
        let leaf = parse_bundle(Some(&rolled.data[TLS_CRT]));
        // The serving certificate is signed by the new CA, listed first.
        assert!(
            leaf[0]
                .x509()
                .unwrap()
                .verify_signature(Some(bundle[0].x509().unwrap().public_key()))
                .is_ok()
        );
        // The old CA leaves the bundle once it has expired.
        let later = plan(&rolled.data, at(361 * DAY), &params()).unwrap();
        assert_eq!(bundle_len(&later.ca_bundle), 1);
    }

    #[test]
    fn broken_secret_data_is_replaced_not_a_panic() {
        let mut junk = BTreeMap::new();
        junk.insert(TLS_CRT.to_owned(), b"not a cert".to_vec());
        junk.insert(CA_KEY.to_owned(), vec![0xff, 0xfe]);
        let p = plan(&junk, at(0), &params()).unwrap();
        assert!(p.changed());
        assert_eq!(bundle_len(&p.ca_bundle), 1);
        assert!(
            plan(
                &BTreeMap::new(),
                at(0),
                &CertParams {
                    validity: Duration::from_secs(1),
                    ..params()
                }
            )
            .is_err()
        );
    }

    #[test]
    fn keys_written_by_others_do_not_cause_rewrites() {
        let first = plan(&BTreeMap::new(), at(0), &params()).unwrap();
        let mut data = first.data.clone();
        data.insert("extra".to_owned(), b"someone else's".to_vec());
        assert!(!plan(&data, at(DAY), &params()).unwrap().changed());
    }

    #[test]
    fn renamed_namespace_reissues_the_serving_cert_only() {
        let first = plan(&BTreeMap::new(), at(0), &params()).unwrap();
        let moved = CertParams {
            namespace: "gw".into(),
            ..params()
        };
        let p = plan(&first.data, at(DAY), &moved).unwrap();
        assert!(
            p.reasons.iter().any(|r| r.contains("names")),
            "{:?}",
            p.reasons
        );
        assert_eq!(p.data[CA_KEY], first.data[CA_KEY]);
    }
}
