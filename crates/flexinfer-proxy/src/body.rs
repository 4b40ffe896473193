//! Response bodies: the proxy's own (small, in memory) and the backend's, streamed frame by frame
//! with a guard that lives exactly as long as the client reads (or until it goes away).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// Error type of every response body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of every response the proxy sends.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A complete in-memory body.
pub fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// The backend's body, polled only when the client connection can take more (hyper polls the
/// body when the socket is writable: back-pressure reaches the backend through TCP), and `G`
/// dropped when the stream ends or the client disconnects (which also drops the backend
/// connection, so the backend sees the disconnect).
pub struct Guarded<B, G> {
    inner: B,
    _guard: G,
    /// Called once, when the first data frame passes (time-to-first-byte).
    on_first: Option<Box<dyn FnOnce() + Send>>,
}

impl<B, G> Guarded<B, G> {
    pub fn new(inner: B, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
            on_first: None,
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

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(Some(Ok(f))) => {
                if f.is_data() {
                    if let Some(first) = this.on_first.take() {
                        first();
                    }
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
