//! Memory of reading a request body's `model`: the peek and the rewrite of an 8 MB
//! body must not allocate in proportion to what they skip. A counting allocator records the peak
//! of live heap bytes above the level before each call (this binary has one test, so no other
//! test allocates meanwhile). `--nocapture` prints the figures (docs/benchmarks.md).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use flexinfer_proxy::server;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak heap bytes above the starting level while `f` runs.
fn peak_of<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (PEAK.load(Ordering::Relaxed).saturating_sub(base), out)
}

fn wide(prefix: &str, total: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(total + 8);
    b.extend_from_slice(prefix.as_bytes());
    while b.len() + 4 < total {
        b.extend_from_slice(b"0,");
    }
    b.extend_from_slice(b"0]}");
    b
}

/// The earlier reading (before the streaming peek), measured side by side: `model` parsed into a
/// `serde_json::Value`, and the rewrite through a whole tree.
fn tree_peek(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Peek {
        model: Option<serde_json::Value>,
    }
    match serde_json::from_slice::<Peek>(body).ok()?.model {
        Some(serde_json::Value::String(s)) => Some(s),
        _ => None,
    }
}

fn tree_rewrite(body: &[u8], served: &str) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("model".into(), serde_json::Value::String(served.into()));
    serde_json::to_vec(&v).ok()
}

#[test]
fn an_8_mb_wide_body_costs_no_more_than_one_copy() {
    const MB: usize = 1_000_000;
    let slack = 64 << 10;
    // The model is the wide value: refused (400) without storing it.
    let as_model = wide(r#"{"model":["#, 8 * MB);
    let (peek, r) = peak_of(|| server::requested_model(&as_model));
    assert_eq!(r.map_err(|e| e.status.as_u16()), Err(400));
    // The wide value is another field: the model is read, and the rewrite copies the body once.
    let beside = wide(r#"{"model":"alias","messages":["#, 8 * MB);
    let (peek_beside, r) = peak_of(|| server::requested_model(&beside));
    assert_eq!(r.ok().as_deref(), Some("alias"));
    let (rewrite, r) = peak_of(|| server::rewrite_model(&beside, "served-name"));
    let out = r.unwrap_or_else(|e| panic!("rewrite: {e:?}"));
    drop(out);
    let (tree_as_model, r) = peak_of(|| tree_peek(&as_model));
    assert_eq!(r, None);
    let (tree_beside, r) = peak_of(|| tree_peek(&beside));
    assert_eq!(r.as_deref(), Some("alias"));
    let (tree_rewritten, r) = peak_of(|| tree_rewrite(&beside, "served-name"));
    assert!(r.is_some());
    drop(r);
    eprintln!(
        "earlier tree reading, same bodies: peek of a wide model {tree_as_model} B ({:.2}x), peek beside it {tree_beside} B ({:.2}x), rewrite {tree_rewritten} B ({:.2}x)",
        tree_as_model as f64 / as_model.len() as f64,
        tree_beside as f64 / beside.len() as f64,
        tree_rewritten as f64 / beside.len() as f64,
    );
    eprintln!(
        "body {} bytes: peek of a wide model {peek} B ({:.2}x), peek beside it {peek_beside} B ({:.2}x), rewrite {rewrite} B ({:.2}x)",
        as_model.len(),
        peek as f64 / as_model.len() as f64,
        peek_beside as f64 / beside.len() as f64,
        rewrite as f64 / beside.len() as f64,
    );
    assert!(
        peek <= slack,
        "peek of {{\"model\":[0,…]}} allocated {peek} bytes"
    );
    assert!(peek_beside <= slack, "peek allocated {peek_beside} bytes");
    assert!(
        rewrite <= beside.len() + slack,
        "rewrite allocated {rewrite} bytes for a {} byte body",
        beside.len()
    );
    // The rewrite changes the model only: same order of fields, same bytes elsewhere.
    let out = server::rewrite_model(&beside, "served-name").unwrap_or_else(|e| panic!("{e:?}"));
    assert!(out.starts_with(br#"{"model":"served-name","messages":[0,0"#));
    assert_eq!(
        out.len(),
        beside.len() + "served-name".len() - "alias".len()
    );
}
