//! The apply step: server-side apply of an owned object only when it would change something.
//! Each owned kind keeps its cache and, per pipeline, what the operator last applied (a hash
//! of it) and what the API server answered; an object is applied again when the wanted one
//! differs, when someone else changed or deleted it (its generation, or for kinds whose spec
//! changes do not move one its resourceVersion, moved past the answer), or when the cached copy
//! lacks a label, annotation or owner the operator sets (an edit of metadata moves no
//! generation). Nothing is applied on a timer: the watches show every change, and an object
//! as left costs no request however long it stands. An object of an owned name that the
//! pipeline does not own is never written: no adoption.

use crate::cache::Cached;
use crate::error::{at, ensure_owned, Error};
use crate::labels::{pipeline_of, FIELD_MANAGER};
use crate::metrics::Step;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

/// One owned kind: its cache and what was last applied per pipeline ("namespace/name").
pub struct Owned<K: Resource<DynamicType = ()> + 'static> {
    pub cache: Cached<K>,
    changes: Changes,
    applied: Mutex<HashMap<String, Applied<K>>>,
}

/// What moves when someone else changes a kind's spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Changes {
    /// metadata.generation (Deployments, PDBs, NetworkPolicies); status updates do not.
    Generation,
    /// Only the resourceVersion (Services: the API server keeps no generation for them).
    ResourceVersion,
}

struct Applied<K> {
    wanted: u64,
    answer: Arc<K>,
}

/// Did the object stay as the apply left it? Its uid is the same and its generation has not
/// moved past the answer's (a stale cache shows an older one), or, for kinds tracked by
/// resourceVersion, that is the answer's.
fn as_left<K: Resource>(changes: Changes, live: &K, answer: &K) -> bool {
    let (l, a) = (live.meta(), answer.meta());
    l.uid == a.uid
        && match changes {
            Changes::Generation => l.generation.unwrap_or(0) <= a.generation.unwrap_or(0),
            Changes::ResourceVersion => l.resource_version == a.resource_version,
        }
}

/// Does `live` still carry the labels, annotations and owners `wanted` sets? Others may add
/// their own (the Deployment controller's revision annotation); removing or changing ours is
/// drift.
fn metadata_kept<K: Resource>(live: &K, wanted: &K) -> bool {
    let (l, w) = (live.meta(), wanted.meta());
    let within = |w: &Option<BTreeMap<String, String>>, l: &Option<BTreeMap<String, String>>| {
        (w.iter().flatten()).all(|(k, v)| l.as_ref().and_then(|l| l.get(k)) == Some(v))
    };
    let owners = |m: &kube::api::ObjectMeta| {
        (m.owner_references.iter().flatten())
            .map(|o| (o.uid.clone(), o.controller))
            .collect::<HashSet<_>>()
    };
    within(&w.labels, &l.labels)
        && within(&w.annotations, &l.annotations)
        && owners(w).is_subset(&owners(l))
}

fn hash_of<K: Serialize>(obj: &K) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(obj)
        .expect("an object serializes")
        .hash(&mut h);
    h.finish()
}

impl<K> Owned<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug
        + Send
        + Sync,
{
    pub fn new(cache: Cached<K>, changes: Changes) -> Self {
        Owned {
            cache,
            changes,
            applied: Mutex::new(HashMap::new()),
        }
    }

    /// The newest copy known of `pipeline`'s object `ns/name`: the cache's, unless it has
    /// not yet seen the operator's own last apply (then that apply's answer).
    pub fn current(&self, pipeline: &str, ns: &str, name: &str) -> Option<Arc<K>> {
        let live = self.cache.get(ns, name);
        let applied = self.applied.lock().expect("applied objects");
        let answer = applied.get(pipeline).map(|a| a.answer.clone());
        match (live, answer) {
            (Some(live), Some(answer)) => {
                let behind = live.meta().uid == answer.meta().uid
                    && live.meta().generation < answer.meta().generation;
                Some(if behind { answer } else { live })
            }
            (live, answer) => live.or(answer),
        }
    }

    /// Applies `obj` for `pipeline` unless it is already as wanted; the object as it now is.
    /// An object of its name that the pipeline does not own (someone else's, another
    /// pipeline's) is never written: the caches hold only objects labelled as ours, so one
    /// missing from them is read first (a GET, normally only before the object is created).
    pub async fn apply(
        &self,
        client: &kube::Client,
        pipeline: &str,
        obj: &K,
    ) -> Result<Arc<K>, Error> {
        let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
        let api = Api::<K>::namespaced(client.clone(), &ns);
        let live = match self.cache.get(&ns, &name) {
            Some(live) => Some(live),
            None => (api.get_opt(&name).await)
                .map_err(at(Step::Apply, obj))?
                .map(Arc::new),
        };
        let (owner_uid, owner) = pipeline_of(obj.meta()).expect("built objects name their owner");
        ensure_owned(
            Step::Apply,
            &ns,
            &name,
            live.as_deref(),
            (Some(owner_uid), owner),
        )?;
        let wanted = hash_of(obj);
        let unchanged = live.as_ref().is_some_and(|live| {
            let applied = self.applied.lock().expect("applied objects");
            applied.get(pipeline).is_some_and(|a| {
                a.wanted == wanted
                    && as_left(self.changes, live.as_ref(), a.answer.as_ref())
                    && metadata_kept(live.as_ref(), obj)
            })
        });
        if let (true, Some(live)) = (unchanged, &live) {
            return Ok(self.current(pipeline, &ns, &name).unwrap_or(live.clone()));
        }
        tracing::debug!(
            "{pipeline}: applying {} {ns}/{name} ({})",
            K::kind(&()),
            if live.is_some() {
                "changed, or drifted"
            } else {
                "absent"
            }
        );
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let answer =
            (api.patch(&name, &pp, &Patch::Apply(obj)).await).map_err(at(Step::Apply, obj))?;
        let answer = Arc::new(answer);
        self.applied.lock().expect("applied objects").insert(
            pipeline.to_string(),
            Applied {
                wanted,
                answer: answer.clone(),
            },
        );
        Ok(answer)
    }

    /// Forgets pipelines that are gone (`live`: the keys of those that are not).
    pub fn retain(&self, live: &HashSet<String>) {
        self.applied
            .lock()
            .expect("applied objects")
            .retain(|k, _| live.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Service;
    use kube::api::ObjectMeta;

    fn service(uid: &str, generation: Option<i64>, rv: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                generation,
                resource_version: Some(rv.into()),
                ..ObjectMeta::default()
            },
            ..Service::default()
        }
    }

    #[test]
    fn an_object_is_as_left_until_someone_else_changes_or_replaces_it() {
        use Changes::*;
        let answer = service("u1", Some(3), "100");
        // The cache has caught up, or not yet (an older generation): as left.
        assert!(as_left(Generation, &service("u1", Some(3), "107"), &answer));
        assert!(as_left(Generation, &service("u1", Some(2), "90"), &answer));
        // Someone edited the spec, or deleted and re-created it.
        assert!(!as_left(
            Generation,
            &service("u1", Some(4), "120"),
            &answer
        ));
        assert!(!as_left(
            Generation,
            &service("u2", Some(1), "130"),
            &answer
        ));
        // Kinds tracked by resourceVersion: it must be the answer's, generation or not.
        assert!(as_left(
            ResourceVersion,
            &service("u1", Some(1), "100"),
            &answer
        ));
        assert!(!as_left(
            ResourceVersion,
            &service("u1", Some(1), "101"),
            &answer
        ));
    }

    #[test]
    fn metadata_drift_is_ours_removed_or_changed_not_others_added() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let owner = |uid: &str| OwnerReference {
            uid: uid.into(),
            controller: Some(true),
            ..OwnerReference::default()
        };
        let with = |labels, annotations, owners: Vec<OwnerReference>| Service {
            metadata: ObjectMeta {
                labels,
                annotations,
                owner_references: Some(owners),
                ..ObjectMeta::default()
            },
            ..Service::default()
        };
        let wanted = with(map(&[("a", "1")]), map(&[("n", "x")]), vec![owner("p")]);
        let added = with(
            map(&[("a", "1"), ("b", "2")]),
            map(&[("n", "x"), ("rev", "3")]),
            vec![owner("p")],
        );
        assert!(metadata_kept(&added, &wanted));
        for drifted in [
            with(map(&[("a", "2")]), map(&[("n", "x")]), vec![owner("p")]),
            with(None, map(&[("n", "x")]), vec![owner("p")]),
            with(map(&[("a", "1")]), None, vec![owner("p")]),
            with(map(&[("a", "1")]), map(&[("n", "x")]), vec![owner("q")]),
        ] {
            assert!(!metadata_kept(&drifted, &wanted), "{:?}", drifted.metadata);
        }
    }
}
