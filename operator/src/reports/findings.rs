//! What the report controller keeps of the pods it judged: each pod's results, for the pods
//! that have any. A pod with nothing to report costs nothing here, so the controller's memory
//! follows its findings, not the cluster's pods.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};

use gpuwarden_webhook::report::ReportResult;

/// One pod's results, and the listing of every pod it was last seen in.
#[derive(Debug)]
struct Judged {
    results: Vec<ReportResult>,
    round: u64,
}

/// The results of every pod with findings, by namespace and pod name.
#[derive(Debug, Default)]
pub struct Findings(Mutex<HashMap<String, BTreeMap<String, Judged>>>);

impl Findings {
    fn map(&self) -> MutexGuard<'_, HashMap<String, BTreeMap<String, Judged>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what was judged of pod `name` of `namespace`, seen in listing `round`;
    /// returns whether the namespace's findings changed.
    pub fn record(
        &self,
        namespace: &str,
        name: &str,
        results: Vec<ReportResult>,
        round: u64,
    ) -> bool {
        let mut map = self.map();
        if results.is_empty() {
            return remove(&mut map, namespace, name);
        }
        let pods = map.entry(namespace.to_owned()).or_default();
        match pods.get_mut(name) {
            Some(judged) => {
                judged.round = round;
                let changed = judged.results != results;
                judged.results = results;
                changed
            }
            None => {
                pods.insert(name.to_owned(), Judged { results, round });
                true
            }
        }
    }

    /// Forgets a deleted pod; returns whether it had findings.
    pub fn forget(&self, namespace: &str, name: &str) -> bool {
        remove(&mut self.map(), namespace, name)
    }

    /// Forgets the pods of `namespace` not in `listed`; returns whether any had findings.
    pub fn keep_only(&self, namespace: &str, listed: &BTreeSet<String>) -> bool {
        let mut map = self.map();
        let Some(pods) = map.get_mut(namespace) else {
            return false;
        };
        let before = pods.len();
        pods.retain(|name, _| listed.contains(name));
        let changed = pods.len() != before;
        if pods.is_empty() {
            map.remove(namespace);
        }
        changed
    }

    /// Forgets every pod not seen since listing `round` (gone while the watch was away);
    /// returns the namespaces whose findings changed.
    pub fn forget_unseen(&self, round: u64) -> Vec<String> {
        let mut changed = Vec::new();
        self.map().retain(|namespace, pods| {
            let before = pods.len();
            pods.retain(|_, judged| judged.round >= round);
            if pods.len() != before {
                changed.push(namespace.clone());
            }
            !pods.is_empty()
        });
        changed
    }

    /// The results of every pod of `namespace`.
    pub fn of(&self, namespace: &str) -> Vec<ReportResult> {
        (self.map().get(namespace).into_iter())
            .flat_map(|pods| pods.values())
            .flat_map(|judged| judged.results.iter().cloned())
            .collect()
    }

    /// How many pods have findings.
    pub fn pods(&self) -> usize {
        self.map().values().map(BTreeMap::len).sum()
    }
}

fn remove(
    map: &mut HashMap<String, BTreeMap<String, Judged>>,
    namespace: &str,
    name: &str,
) -> bool {
    let Some(pods) = map.get_mut(namespace) else {
        return false;
    };
    let removed = pods.remove(name).is_some();
    if pods.is_empty() {
        map.remove(namespace);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(message: &str) -> ReportResult {
        serde_json::from_value(serde_json::json!({
            "source": "gpuwarden", "policy": "p", "rule": "r", "category": "c",
            "severity": "high", "timestamp": {"seconds": 0, "nanos": 0}, "result": "fail",
            "scored": true, "resources": [], "message": message, "properties": {}
        }))
        .expect("a result")
    }

    #[test]
    fn only_pods_with_findings_are_kept_and_a_change_is_told() {
        let f = Findings::default();
        assert!(
            !f.record("ml", "clean", vec![], 1),
            "nothing found, nothing kept"
        );
        assert!(f.record("ml", "a", vec![result("x")], 1));
        assert!(
            !f.record("ml", "a", vec![result("x")], 1),
            "the same results"
        );
        assert!(f.record("ml", "a", vec![result("y")], 1));
        assert_eq!(f.of("ml"), vec![result("y")]);
        assert!(f.record("ml", "a", vec![], 1), "its findings went");
        assert_eq!((f.pods(), f.of("ml")), (0, vec![]));
    }

    #[test]
    fn pods_not_seen_in_a_listing_are_forgotten() {
        let f = Findings::default();
        f.record("a", "old", vec![result("x")], 1);
        f.record("b", "kept", vec![result("x")], 1);
        f.record("b", "kept", vec![result("x")], 2);
        assert_eq!(f.forget_unseen(2), vec!["a".to_owned()]);
        assert_eq!(f.pods(), 1);
        assert!(!f.keep_only("b", &BTreeSet::from(["kept".to_owned()])));
        assert!(f.keep_only("b", &BTreeSet::new()));
        assert!(!f.forget("b", "kept"), "already gone");
    }
}
