//! Response bodies: the proxy's own (small, in memory) and the backend's, streamed frame by frame
//! with a guard that lives exactly as long as the client reads (or until it goes away).
//!
//! Data frames that the backend has already delivered when the client side asks for more are
//! passed on as one frame (up to [`COALESCE_MAX`] bytes): the bytes are unchanged, only the
//! number of chunks (and writes) is smaller. Nothing waits to be coalesced: a frame is never
//! held back for one that has not arrived yet.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// Error type of every response body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of every response the proxy sends.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;
/// One answer of a body's `poll_frame`.
pub type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

/// A complete in-memory body.
pub fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Most bytes joined into one frame: an SSE token event is ~100–300 bytes, so this is hundreds of
/// events when the backend is ahead of the client, and small enough not to hold memory.
pub const COALESCE_MAX: usize = 64 << 10;

/// What [`Guarded`] polled while coalescing and could not join: returned by the next poll.
type Held = Option<Result<Frame<Bytes>, BoxError>>;

/// The backend's body, polled only when the client connection can take more (hyper polls the
/// body when the socket is writable: back-pressure reaches the backend through TCP), and `G`
/// dropped when the stream ends or the client disconnects (which also drops the backend
/// connection, so the backend sees the disconnect).
pub struct Guarded<B, G> {
    inner: B,
    _guard: G,
    /// Called once, when the first data frame passes (time-to-first-byte).
    on_first: Option<Box<dyn FnOnce() + Send>>,
    /// A trailers frame, an error or the end met while coalescing, for the next poll.
    held: Option<Held>,
}

impl<B, G> Guarded<B, G> {
    pub fn new(inner: B, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
            on_first: None,
            held: None,
        }
    }

    /// Call `f` when the first data frame is passed on.
    pub fn on_first_frame(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.on_first = Some(Box::new(f));
        self
    }
}

impl<B, G> Body for Guarded<B, G>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    G: Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = self.get_mut();
        if let Some(held) = this.held.take() {
            return Poll::Ready(held);
        }
        let first = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        let first = match first.into_data() {
            Ok(data) => data,
            Err(other) => return Poll::Ready(Some(Ok(other))),
        };
        if let Some(f) = this.on_first.take() {
            f();
        }
        // Join the data frames that are already there; stop at the first that is not.
        let mut joined: Option<BytesMut> = None;
        let mut len = first.len();
        while len < COALESCE_MAX {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => match f.into_data() {
                    Ok(more) => {
                        len = len.saturating_add(more.len());
                        joined
                            .get_or_insert_with(|| {
                                let mut b = BytesMut::with_capacity(
                                    COALESCE_MAX.min(len.saturating_mul(2)),
                                );
                                b.extend_from_slice(&first);
                                b
                            })
                            .extend_from_slice(&more);
                    }
                    Err(other) => {
                        this.held = Some(Some(Ok(other)));
                        break;
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    this.held = Some(Some(Err(e.into())));
                    break;
                }
                Poll::Ready(None) => {
                    this.held = Some(None);
                    break;
                }
                Poll::Pending => break,
            }
        }
        let data = joined.map_or(first, BytesMut::freeze);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        match &self.held {
            Some(None) => true,
            Some(Some(_)) => false,
            None => self.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A body that answers its polls from a script; `Pending` entries wake the task at once.
    struct Scripted(VecDeque<Polled>);

    impl Body for Scripted {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
            match self.get_mut().0.pop_front() {
                Some(Poll::Pending) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Some(p) => p,
                None => Poll::Ready(None),
            }
        }
        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    fn data(s: &str) -> Polled {
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(s.to_string())))))
    }

    /// What the client side sees: each frame as data text, `T` for trailers, `E:<msg>` for an error.
    async fn frames(script: Vec<Polled>) -> Vec<String> {
        let mut b = Guarded::new(Scripted(script.into()), ());
        let mut out = Vec::new();
        while let Some(f) = b.frame().await {
            out.push(match f {
                Ok(f) if f.is_data() => String::from_utf8(f.into_data().unwrap().to_vec()).unwrap(),
                Ok(_) => "T".to_string(),
                Err(e) => format!("E:{e}"),
            });
        }
        out
    }

    #[tokio::test]
    async fn joins_only_the_frames_already_there_and_keeps_every_byte() {
        let got = frames(vec![
            data("a"),
            data("b"),
            data("c"),
            Poll::Pending,
            data("d"),
            Poll::Pending,
            data("e"),
            data("f"),
        ])
        .await;
        assert_eq!(got, ["abc", "d", "ef"]);
    }

    #[tokio::test]
    async fn trailers_and_errors_follow_the_data_they_came_after() {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-t", "1".parse().unwrap());
        let got = frames(vec![
            data("a"),
            data("b"),
            Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
        ])
        .await;
        assert_eq!(got, ["ab", "T"]);
        let got = frames(vec![
            data("a"),
            data("b"),
            Poll::Ready(Some(Err("backend reset".into()))),
        ])
        .await;
        assert_eq!(got, ["ab", "E:backend reset"]);
        // The end met while joining: the joined data, then the end.
        let mut b = Guarded::new(Scripted(vec![data("a"), data("b")].into()), ());
        assert_eq!(b.frame().await.unwrap().unwrap().into_data().unwrap(), "ab");
        assert!(b.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_joined_frame_stays_within_the_bound() {
        let chunk = "x".repeat(1000);
        let script: Vec<_> = (0..200).map(|_| data(&chunk)).collect();
        let got = frames(script).await;
        assert_eq!(got.iter().map(String::len).sum::<usize>(), 200 * 1000);
        // Each frame stops growing once it reaches the bound, so it exceeds it by less than one chunk.
        assert!(got.len() >= 3, "{} frames", got.len());
        assert!(got.iter().all(|f| f.len() < COALESCE_MAX + 1000));
    }

    #[tokio::test]
    async fn time_to_first_byte_is_reported_once() {
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        let mut b = Guarded::new(
            Scripted(vec![data("a"), Poll::Pending, data("b")].into()),
            (),
        )
        .on_first_frame(move || {
            m.fetch_add(1, Ordering::SeqCst);
        });
        while b.frame().await.is_some() {}
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }
}
