//! A store that throttles (503 SlowDown) asks for a slower rate; it is not failing. A read it
//! throttles for longer than the worker's attempts at other failures allow (4, each after
//! the SDK's own 3) is retried with the worker's backoff until served, within
//! `THROTTLED_FOR`, instead of failing its request, which would only send the same read to
//! another worker of the same store, sooner.

use stoker_testkit::embedded_s3::{EmbeddedS3, Faults, StoreBehaviour};
use stoker_worker::source::{ReadCap, Store, FETCH_ATTEMPTS};

#[tokio::test]
async fn a_read_throttled_past_the_fetch_attempts_is_served_not_failed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("bucket/data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("image.jpg"), b"the image's bytes").unwrap();
    // Every attempt of the first four rounds (the SDK's 3 each) is throttled.
    let throttled = 3 * FETCH_ATTEMPTS as u64;
    let behaviour = StoreBehaviour {
        faults: Faults {
            first_slow_downs: throttled,
            ..Faults::default()
        },
        ..StoreBehaviour::default()
    };
    let s3 = EmbeddedS3::start_with(dir.path(), "127.0.0.1:0", behaviour)
        .await
        .unwrap();
    let store = Store::open("s3://bucket/data", &s3.s3_options())
        .await
        .unwrap();
    let cap = ReadCap {
        bytes: 1 << 20,
        name: "the test's cap",
    };
    let bytes = store.get_at_most("image.jpg", cap).await.unwrap();
    assert_eq!(&bytes[..], b"the image's bytes");
    assert_eq!(s3.faults_injected(), throttled);
    assert_eq!(s3.requests_received(), throttled + 1);
}
