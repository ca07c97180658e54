//! What the operator watches instead of asking: one reflector per kind a reconcile reads, so a
//! reconcile makes no read request at all. Owned objects and worker pods are watched by our
//! labels (never every Deployment or Pod of the cluster); Nodes, which no label of ours
//! selects, are stripped to what placement reads. Trainer pods are watched per pipeline's
//! selector while some pipeline scrapes them (`TrainerPods`).
//!
//! Cost: one LIST + one long-lived WATCH per kind (re-listed when a watch expires), memory
//! per object watched; a reconcile then costs a lookup.

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// A reflector's store and whether its first list is in.
pub struct Cached<K: Resource<DynamicType = ()> + 'static> {
    pub store: Store<K>,
    synced: watch::Receiver<bool>,
}

impl<K: Resource<DynamicType = ()> + Clone + 'static> Cached<K> {
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits (up to `limit`) for the first list; false if it did not come.
    pub async fn synced_within(&self, limit: Duration) -> bool {
        let mut rx = self.synced.clone();
        tokio::time::timeout(limit, rx.wait_for(|s| *s))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<K>> {
        self.store.get(&ObjectRef::new(name).within(namespace))
    }

    /// A cache already listed, holding `objects`, and its writer (the reconcile tests play
    /// the watch through it).
    #[cfg(test)]
    pub fn holding(objects: Vec<K>) -> (Self, reflector::store::Writer<K>) {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        for o in objects {
            writer.apply_watcher_event(&watcher::Event::InitApply(o));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let cached = Cached {
            store,
            synced: watch::channel(true).1,
        };
        (cached, writer)
    }
}

/// A reflector of `api` (selected by `config`), each object passed through `strip` before it
/// is stored: the cache, and the stream that fills it (every object touched, deletions
/// included) for whoever drives it.
pub fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    strip: fn(&mut K),
) -> (
    Cached<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let (synced_tx, synced) = watch::channel(false);
    let stream = watcher(api, config)
        .default_backoff()
        .modify(move |o| {
            o.managed_fields_mut().clear();
            strip(o);
        })
        .reflect(writer)
        .inspect(move |event| {
            if matches!(event, Ok(watcher::Event::InitDone)) {
                synced_tx.send_replace(true);
            }
        })
        .touched_objects();
    (Cached { store, synced }, logged(stream))
}

/// A watch stream without its errors, each logged. The watcher retries by itself with its own
/// backoff; passed on, every error would also pause the controller's merged trigger stream (by
/// its own backoff, up to 30 s per error, for every watch at once): after an API server
/// restart, minutes without a reconcile.
pub fn logged<K: Resource<DynamicType = ()> + Send + 'static>(
    stream: impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    stream.filter_map(|r| {
        futures::future::ready(match r {
            Ok(o) => Some(Ok(o)),
            Err(e) => {
                tracing::warn!("watching {}: {e}", K::kind(&()));
                None
            }
        })
    })
}

/// Nothing beyond metadata (managed fields go for every kind).
pub fn keep_all<K>(_: &mut K) {}

/// A Node as placement reads it: labels, schedulability, taints, allocatable.
pub fn strip_node(n: &mut Node) {
    n.annotations_mut().clear();
    if let Some(s) = n.status.as_mut() {
        s.images = None;
        s.conditions = None;
        s.volumes_attached = None;
        s.volumes_in_use = None;
        s.node_info = None;
        s.addresses = None;
    }
}

/// A pod as the operator reads it: where it runs, its phase and address.
pub fn strip_pod(p: &mut Pod) {
    p.annotations_mut().clear();
    if let Some(spec) = p.spec.as_mut() {
        let node = spec.node_name.take();
        *spec = Default::default();
        spec.node_name = node;
    }
    if let Some(s) = p.status.as_mut() {
        let (phase, ip) = (s.phase.take(), s.pod_ip.take());
        *s = Default::default();
        (s.phase, s.pod_ip) = (phase, ip);
    }
}

/// How long a reconcile waits for a trainer-pod watch's first list before reading nothing.
const TRAINER_SYNC_WAIT: Duration = Duration::from_secs(10);

/// Trainer pods, one label-selected watch per (namespace, selector) some pipeline scrapes;
/// a watch nobody uses any more is stopped by [`TrainerPods::retain`].
pub struct TrainerPods {
    client: kube::Client,
    watches: Mutex<HashMap<(String, String), TrainerWatch>>,
}

struct TrainerWatch {
    pods: Arc<Cached<Pod>>,
    task: tokio::task::AbortHandle,
}

impl Drop for TrainerWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TrainerPods {
    pub fn new(client: kube::Client) -> Self {
        TrainerPods {
            client,
            watches: Mutex::new(HashMap::new()),
        }
    }

    /// The running pods of `namespace` matching `selector` (`k=v,...`), from a watch started
    /// on first use; `None` if its first list has not come within a few seconds.
    pub async fn running(&self, namespace: &str, selector: &str) -> Option<Vec<Arc<Pod>>> {
        let key = (namespace.to_string(), selector.to_string());
        let pods = {
            let mut watches = self.watches.lock().expect("trainer watches");
            watches
                .entry(key)
                .or_insert_with(|| {
                    let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
                    let (pods, stream) =
                        reflect(api, watcher::Config::default().labels(selector), strip_pod);
                    let task = tokio::spawn(stream.for_each(|_| async {})).abort_handle();
                    TrainerWatch {
                        pods: Arc::new(pods),
                        task,
                    }
                })
                .pods
                .clone()
        };
        if !pods.synced_within(TRAINER_SYNC_WAIT).await {
            return None;
        }
        let running =
            |p: &Pod| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        Some(
            pods.store
                .state()
                .into_iter()
                .filter(|p| running(p))
                .collect(),
        )
    }

    /// Stops the watches no live pipeline uses (`in_use`: their (namespace, selector)).
    pub fn retain(&self, in_use: &std::collections::HashSet<(String, String)>) {
        self.watches
            .lock()
            .expect("trainer watches")
            .retain(|k, _| in_use.contains(k));
    }
}
